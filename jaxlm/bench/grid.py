"""The benchmark's options and grid: each cell's runs, timings and memory, and the whole report."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .report import cell_line, format_report
from .runners import JaxlmRunner, LlamaCppRunner, TransformersRunner, llama_cpp_status
from .system import (
    OtherLoad,
    cores,
    cpu_name,
    current_rss,
    l3_bytes,
    memory_bandwidth,
    peak_rss,
    persistent_cache,
    reset_peak_rss,
)

DEFAULT_BATCH = (1, 4, 8)
DEFAULT_PROMPT_LEN = (32, 128, 512)
DEFAULT_NEW_TOKENS = (128,)
ENGINES = ("transformers", "llama.cpp")
SEED = 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options (all but `--model`, `--dtype` and `--mesh`) to `parser`."""
    parser.add_argument("--batch", type=_int_list, default=DEFAULT_BATCH, help="e.g. 1,4,8")
    parser.add_argument(
        "--prompt-len", type=_int_list, default=DEFAULT_PROMPT_LEN, help="e.g. 32,128,512"
    )
    parser.add_argument("--new-tokens", type=_int_list, default=DEFAULT_NEW_TOKENS, help="e.g. 128")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per cell")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this file")
    parser.add_argument(
        "--vs",
        action="append",
        choices=ENGINES,
        default=[],
        help="also run this engine on the same weights (repeatable)",
    )
    parser.add_argument(
        "--bandwidth-mib",
        type=int,
        default=1024,
        help="size of the memory bandwidth probe's array (default 1024)",
    )


# The cells.


def random_prompts(vocab: int, batch: int, length: int, seed: int = SEED) -> list[list[int]]:
    """`batch` prompts of exactly `length` random token ids."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (batch, length)).tolist()


def throughput(batch: int, prompt_len: int, new_tokens: int, t1: float, tn: float) -> dict:
    """Prefill and decode rates of one repeat from the times of 1 and `new_tokens` new tokens."""
    decode = None
    if new_tokens > 1 and tn > t1:
        decode = (new_tokens - 1) / (tn - t1)
    return {
        "prefill_tok_s": batch * prompt_len / t1,
        "decode_tok_s_per_row": decode,
        "decode_tok_s": None if decode is None else batch * decode,
        "ttft_s": t1,
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(batch: int, prompt_len: int, new_tokens: int, t1s, tns) -> dict:
    """Medians over repeats of each rate, and the raw times."""
    per_repeat = [
        throughput(batch, prompt_len, new_tokens, t1, tn) for t1, tn in zip(t1s, tns, strict=True)
    ]
    out = {k: _median([r[k] for r in per_repeat]) for k in per_repeat[0]}
    out["repeats"] = per_repeat
    out["t1_s"] = list(t1s)
    out["tn_s"] = list(tns)
    return out


# The benchmark.


def _weights_read_per_step(model, weights: int) -> int:
    """Bytes of weights one decode step reads: all but an untied input embedding."""
    if model.config.tie_word_embeddings:
        return weights
    embedding = model.model.embed_tokens.weight[...]
    return weights - embedding.size * embedding.dtype.itemsize


def _first_call(runner: JaxlmRunner, cell: tuple[int, int, int], prompts, label: str):
    """Plan and first `generate` of a cell, timed; `label` names the times: `"cold"` (an empty
    persistent cache) or `"cached"` (after `jax.clear_caches()`, from the filled cache).

    Returns the times and the plan.
    """
    import jax

    import jaxlm

    if label == "cached":
        jax.clear_caches()
    with jaxlm.CompileCounter() as compiles:
        t = time.perf_counter()
        plan = runner.plan(*cell)
        runner.generate(prompts, 1, plan)
        wall = time.perf_counter() - t
    times = {
        f"first_call_{label}_s": wall,
        # XLA's compile time, and loads from the persistent cache, in seconds.
        f"compile_{label}_s": compiles.seconds,
        f"compiles_{label}": compiles.count,
        f"cache_hits_{label}": compiles.cache_hits,
    }
    return times, plan


def _drop_plans(runner: JaxlmRunner) -> None:
    """Free the plans of `runner`'s model: `generate` keeps the plans it made."""
    from jaxlm.plans import plans_of

    plans_of(runner.model).clear()
    gc.collect()


def run(args) -> dict:
    """Run the benchmark for parsed `args` (see `add_arguments`), print it, return the results."""
    import jax
    import jax.numpy as jnp

    import jaxlm
    from jaxlm.loading import default_model_path
    from jaxlm.sharding import weights_bytes

    # The baseline is the process once JAX is up: its CPU backend started and one executable
    # compiled and run, whose compiler and runtime pages every JAX program pays before a model
    # (see `docs/performance.md`, "Bench RSS").
    jax.jit(lambda x: x + 1)(jnp.zeros(())).block_until_ready()
    baseline_rss = current_rss()
    if args.repeats < 1:
        raise ValueError(f"`--repeats` must be >= 1, got {args.repeats}")
    path = Path(args.model) if args.model else default_model_path()
    t = time.perf_counter()
    # The prompts are random ids: the tokenizer is not kept, as it would add to the peak RSS
    # (see `docs/performance.md`, "Bench RSS").
    model = jaxlm.load(
        path, dtype=args.dtype, progress=False, mesh=args.mesh, quantize=args.quantize
    )[0]
    load_s = time.perf_counter() - t
    loaded_rss, loading_peak = current_rss(), peak_rss()
    weights = weights_bytes(model)
    weights_read = _weights_read_per_step(model, weights)
    jaxlm_runner = JaxlmRunner(model)
    others, skipped = {}, {}
    if "transformers" in args.vs:
        # transformers runs the float32 weights of the file, also beside an int8 model.
        floats = model if args.quantize is None else jaxlm.load(path, progress=False)[0]
        others["transformers"] = TransformersRunner(floats)
        del floats
    if "llama.cpp" in args.vs:
        reason = llama_cpp_status()
        if reason is None and path.suffix != ".gguf":
            reason = f"{path} is not a GGUF file; llama.cpp skipped"
        if reason is None and 1 not in args.batch:
            reason = "llama.cpp runs batch 1 only and the grid has no batch 1; skipped"
        if reason is None:
            n_ctx = max(args.prompt_len) + max(args.new_tokens) + 8
            others["llama.cpp"] = LlamaCppRunner(path, n_ctx)
        else:
            skipped["llama.cpp"] = reason
            print(f"note: {reason}", file=sys.stderr)

    cells = [(b, p, n) for b in args.batch for p in args.prompt_len for n in args.new_tokens]
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="jaxlm-bench-xla-") as cache_dir,
        persistent_cache(cache_dir),
    ):
        for cell in cells:
            results.append(_run_cell(cell, args.repeats, model, jaxlm_runner, others, baseline_rss))
            print(cell_line(results[-1]), file=sys.stderr, flush=True)
    bandwidth = memory_bandwidth(args.bandwidth_mib << 20)
    for r in results:
        _add_bandwidth(r, bandwidth["bytes_per_s"], weights_read)
    report = {
        "machine": {
            "cpu": cpu_name(),
            "cores": cores(),
            "l3_bytes": l3_bytes(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "products": jaxlm.kernels.products(),
        },
        "model": {
            "path": str(path),
            "dtype": str(jnp.dtype(args.dtype)),
            "quantize": args.quantize,
            "parameters": model.config.num_parameters(),
            "weights_bytes": weights,
            "weights_read_per_step_bytes": weights_read,
            "load_s": load_s,
            "rss_after_load_bytes": loaded_rss,
            "peak_rss_while_loading_bytes": loading_peak,
        },
        "bandwidth": bandwidth,
        "baseline_rss_bytes": baseline_rss,
        "settings": {
            "batch": list(args.batch),
            "prompt_len": list(args.prompt_len),
            "new_tokens": list(args.new_tokens),
            "repeats": args.repeats,
            "vs": list(args.vs),
            "seed": SEED,
        },
        "skipped": skipped,
        "cells": results,
    }
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _run_cell(cell, repeats: int, model, runner: JaxlmRunner, others: dict, baseline: int) -> dict:
    b, p, n = cell
    prompts = random_prompts(model.config.vocab_size, b, p)
    cold_info, plan = _first_call(runner, cell, prompts, "cold")
    engines = {"jaxlm": runner} | {
        name: other for name, other in others.items() if not (name == "llama.cpp" and b != 1)
    }
    for name, engine in engines.items():
        if name != "jaxlm":
            engine.generate(prompts, min(n, 2), plan)
    times = {name: ([], []) for name in engines}
    tokens = {}
    # The peak RSS of the cell is that of generating: compiling and loading are behind it.
    peak_reset = reset_peak_rss()
    with OtherLoad() as load:
        for _ in range(repeats):
            for name, engine in engines.items():
                t1, _ = engine.generate(prompts, 1, plan)
                tn, ids = engine.generate(prompts, n, plan)
                times[name][0].append(t1)
                times[name][1].append(tn)
                tokens[name] = ids
    out = {"batch": b, "prompt_len": p, "new_tokens": n, "other_load_cores": load.cores}
    for name, engine in engines.items():
        out[name] = summarize(b, p, n, *times[name])
        perf = getattr(engine, "perf", None)
        if perf:
            # The engine's own counters for its last run of `n` new tokens.
            out[name]["own_counters"] = {
                **perf,
                "prefill_tok_s": 1e3 * perf["prompt_tokens"] / perf["prompt_ms"],
                "decode_tok_s": 1e3 * perf["eval_tokens"] / perf["eval_ms"],
            }
    out["jaxlm"].update(cold_info)
    out["jaxlm"].update(
        peak_rss_bytes=peak_rss(),
        peak_rss_since="generation" if peak_reset else "start",
        rss_bytes=current_rss(),
        plan_total_bytes=plan.total_bytes,
        plan_kv_cache_bytes=plan.kv_cache_bytes,
        plan_executables_host_bytes=plan.executables_host_bytes,
        predicted_peak_bytes=baseline + (plan.resident_bytes or plan.total_bytes),
    )
    ratios = {}
    for name in engines:
        if name == "jaxlm":
            continue
        mine, theirs = out["jaxlm"]["repeats"], out[name]["repeats"]
        ratios[name] = {}
        for key in ("prefill_tok_s", "decode_tok_s"):
            pairs = [
                a[key] / o[key] if a[key] and o[key] else None
                for a, o in zip(mine, theirs, strict=True)
            ]
            ratios[name][key] = {"pairs": pairs, "median": _median(pairs)}
        ratios[name]["same_tokens"] = _same_prefix(tokens["jaxlm"][0], tokens[name][0])
    out["ratios"] = ratios
    # The start from the persistent cache is timed once the cell has run on the cold plan:
    # timed before, it left what the cold plan's compiling kept resident under the plan that
    # the cell then ran on, as in no process that compiles once (see `docs/performance.md`,
    # "Bench RSS").
    del plan
    _drop_plans(runner)
    cached_info, plan = _first_call(runner, cell, prompts, "cached")
    out["jaxlm"].update(cached_info)
    del plan
    _drop_plans(runner)
    return out


def _same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two rows share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _add_bandwidth(result: dict, bandwidth: float, weights_read: int) -> None:
    j = result["jaxlm"]
    steps = j["decode_tok_s_per_row"]
    limit = bandwidth / weights_read
    limit_with_cache = bandwidth / (weights_read + j["plan_kv_cache_bytes"])
    j["bandwidth_limit_steps_s"] = limit
    j["bandwidth_fraction"] = None if steps is None else steps / limit
    j["bandwidth_fraction_with_cache"] = None if steps is None else steps / limit_with_cache
