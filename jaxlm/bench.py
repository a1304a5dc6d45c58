"""`jaxlm bench`: the offline grid that inference engines publish, for jaxlm and optionally others.

For every cell of batch sizes x prompt lengths x new tokens it measures, with medians over
repeats:
- prefill tokens/s and time to first token, from a `generate` of one new token;
- decode tokens/s, from the difference between `N` new tokens and one, per row and in total;
- compile time: cold (an empty persistent compilation cache), and from JAX's persistent cache
  once the cell has run (after `jax.clear_caches()`, as a second start would);
- memory: the process's peak RSS while the cell generates (its high-water mark reset after
  compiling) and its current RSS, against the plan's resident bill (the whole bill and the
  compiled steps' host memory) plus the RSS the process had before it loaded the model.

Prompts are random token ids of exactly the prompt length (fixed seed), decoding is greedy and no
token stops a row, so every row generates all its tokens. A probe measures the machine's memory
read bandwidth, and each decode figure is shown as a fraction of the speed that bandwidth allows
when every step reads all the weights once. `--vs transformers` and `--vs llama.cpp` run the same
cells on the same weights, interleaved with jaxlm repeat by repeat, and print the ratios pair by
pair.

Run `jaxlm bench --help` or `python benchmarks/bench.py --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; the same as `jaxlm bench`."""
    from jaxlm.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


# Measuring the process and the machine.


def current_rss() -> int:
    """The resident set size of this process now, in bytes (`VmRSS`)."""
    from jaxlm.memory import resident_bytes

    return resident_bytes() or 0


def peak_rss() -> int:
    """The largest resident set size of this process since the last `reset_peak_rss`, in bytes
    (`VmHWM`; `ru_maxrss`, the peak since the start, where there is no `/proc`).
    """
    from jaxlm.memory import process_status

    peak = process_status("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Start a new peak RSS measurement (Linux: `5` to `/proc/self/clear_refs`); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def cores() -> int:
    """The number of cores this process may run on."""
    return len(os.sched_getaffinity(0))


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """The best memory read bandwidth of a sum over `nbytes` of float32, in bytes/s.

    Both a numpy sum (one core) and a jitted XLA reduction are timed; the best of `repeats`
    runs of either is the figure.
    """
    import jax
    import jax.numpy as jnp

    n = max(1, nbytes // 4)
    host = np.ones(n, np.float32)
    numpy_s = _best(host.sum, repeats)
    del host
    device = jnp.ones(n, jnp.float32)
    total = jax.jit(jnp.sum)
    total(device).block_until_ready()
    xla_s = _best(lambda: total(device).block_until_ready(), repeats)
    return {
        "bytes_per_s": 4 * n / min(numpy_s, xla_s),
        "numpy_bytes_per_s": 4 * n / numpy_s,
        "xla_bytes_per_s": 4 * n / xla_s,
        "probe_bytes": 4 * n,
        "repeats": repeats,
    }


class OtherLoad:
    """Cores kept busy by other processes while the block runs, from `/proc/stat`.

    On a shared machine this tells a clean measurement from one that competed for the cores.

    Example:
        >>> with OtherLoad() as load:
        ...     work()
        >>> load.cores
    """

    def __init__(self):
        self.cores = 0.0

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        # idle and iowait are the 4th and 5th fields.
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def __enter__(self) -> OtherLoad:
        self._start = (self._busy(), self._own(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = self._start
        elapsed = time.perf_counter() - wall
        others = (self._busy() - busy) - (self._own() - own)
        self.cores = max(0.0, others / elapsed) if elapsed > 0 else 0.0


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _l3_bytes() -> int | None:
    path = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    try:
        text = path.read_text().strip().upper()
    except OSError:
        return None
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


@contextlib.contextmanager
def persistent_cache(path: str):
    """Use `path` as JAX's persistent compilation cache for every executable, then restore."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {name: getattr(jax.config, name) for name in names}
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:
        yield
    finally:
        compilation_cache.reset_cache()
        for name, value in old.items():
            jax.config.update(name, value)


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


class JaxlmRunner:
    """Runs one cell's `generate` calls on a plan made for exactly that cell."""

    name = "jaxlm"

    def __init__(self, model):
        self.model = model

    def plan(self, batch: int, prompt_len: int, new_tokens: int):
        """The plan `generate` makes for this cell."""
        from jaxlm.generate import request_plan

        return request_plan(self.model, batch, prompt_len, new_tokens)

    def generate(self, prompts, new_tokens: int, plan) -> tuple[float, list[list[int]]]:
        import jaxlm

        t = time.perf_counter()
        out = jaxlm.generate(
            self.model, None, prompts, max_new_tokens=new_tokens, stop_token_ids=[], plan=plan
        )
        return time.perf_counter() - t, out.token_ids


class TransformersRunner:
    """transformers' `generate` on a `LlamaForCausalLM` holding the jaxlm model's weights."""

    name = "transformers"

    def __init__(self, model):
        import torch

        torch.set_num_threads(cores())
        self.torch = torch
        self.model = to_transformers(model)

    def generate(self, prompts, new_tokens: int, plan=None) -> tuple[float, list[list[int]]]:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            elapsed = time.perf_counter() - t
        return elapsed, out[:, ids.shape[1] :].tolist()


def to_transformers(model):
    """A transformers causal LM with the same configuration and weights as a jaxlm `model`."""
    import torch
    import transformers

    from jaxlm.loading import checkpoint_tensors

    c = model.config
    rope = {"rope_type": c.rope_scaling.rope_type, "rope_theta": c.rope_theta}
    if c.rope_scaling.rope_type != "default":
        rope["factor"] = c.rope_scaling.factor
    if c.rope_scaling.rope_type == "llama3":
        rope.update(
            low_freq_factor=c.rope_scaling.low_freq_factor,
            high_freq_factor=c.rope_scaling.high_freq_factor,
            original_max_position_embeddings=c.rope_scaling.original_max_position_embeddings,
        )
    kwargs = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        rope_parameters=rope,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_id) or None,
    )
    if c.sliding_window is not None:
        kwargs["sliding_window"] = c.sliding_window
    config = transformers.AutoConfig.for_model(c.model_type, **kwargs)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        str(model.dtype)
    ]
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    state = {}
    for name, value in checkpoint_tensors(model).items():
        if value.dtype == np.uint16:
            # A table stored as the bits of the model's dtype (see `jaxlm.layers.Embedding`).
            value = value.view(model.dtype)
        value = np.array(value, np.float32)
        state[name] = torch.from_numpy(value).to(dtype)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"weights do not match transformers: missing {missing}, extra {unexpected}"
        )
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf


class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) on a GGUF file, batch 1, greedy (argmax on the host)."""

    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int):
        import llama_cpp
        from llama_cpp import llama as high_level

        self.llama_cpp = llama_cpp
        self.perf: dict | None = None
        defaults = high_level.llama_cpp.llama_model_default_params

        def model_params():
            params = defaults()
            # llama.cpp's extra (AMX) buffers crash on quantized files on some CPUs; the
            # `Llama` constructor has no argument for this field of its model parameters.
            params.use_extra_bufts = False
            return params

        high_level.llama_cpp.llama_model_default_params = model_params
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=min(n_ctx, 512),
                n_threads=cores(),
                n_threads_batch=cores(),
                verbose=False,
            )
        finally:
            high_level.llama_cpp.llama_model_default_params = defaults
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts, new_tokens: int, plan=None) -> tuple[float, list[list[int]]]:
        (prompt,) = prompts
        llm, lib = self.llm, self.llama_cpp
        llm.reset()
        lib.llama_memory_clear(lib.llama_get_memory(llm.ctx), True)
        lib.llama_perf_context_reset(llm.ctx)
        t = time.perf_counter()
        llm.eval(prompt)
        out = [self._argmax()]
        while len(out) < new_tokens:
            llm.eval(out[-1:])
            out.append(self._argmax())
        elapsed = time.perf_counter() - t
        perf = lib.llama_perf_context(llm.ctx)
        self.perf = {
            "prompt_tokens": perf.n_p_eval,
            "prompt_ms": perf.t_p_eval_ms,
            "eval_tokens": perf.n_eval,
            "eval_ms": perf.t_eval_ms,
        }
        return elapsed, [out]


def llama_cpp_status() -> str | None:
    """None if llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"`llama_cpp` (llama-cpp-python) is not installed ({e}); skipped"
    return None


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
    from jaxlm.engine import engine_of

    engine_of(runner.model).plans.clear()
    gc.collect()


def run(args) -> dict:
    """Run the benchmark for parsed `args` (see `add_arguments`), print it, return the results."""
    import jax
    import jax.numpy as jnp

    import jaxlm
    from jaxlm.engine import weights_bytes
    from jaxlm.loading import default_model_path

    # The baseline is the process once JAX is up: its CPU backend started and one executable
    # compiled and run, which every JAX program pays before a model (40 MiB of compiler and
    # runtime pages here).
    jax.jit(lambda x: x + 1)(jnp.zeros(())).block_until_ready()
    baseline_rss = current_rss()
    if args.repeats < 1:
        raise ValueError(f"`--repeats` must be >= 1, got {args.repeats}")
    path = Path(args.model) if args.model else default_model_path()
    t = time.perf_counter()
    # The prompts are random ids: the tokenizer is not kept (8 MiB of SmolLM2's peak RSS).
    model = jaxlm.load(path, dtype=args.dtype, progress=False, mesh=args.mesh)[0]
    load_s = time.perf_counter() - t
    loaded_rss, loading_peak = current_rss(), peak_rss()
    weights = weights_bytes(model)
    weights_read = _weights_read_per_step(model, weights)
    jaxlm_runner = JaxlmRunner(model)
    others, skipped = {}, {}
    if "transformers" in args.vs:
        others["transformers"] = TransformersRunner(model)
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
            print(_cell_line(results[-1]), file=sys.stderr, flush=True)
    bandwidth = memory_bandwidth(args.bandwidth_mib << 20)
    for r in results:
        _add_bandwidth(r, bandwidth["bytes_per_s"], weights_read)
    report = {
        "machine": {
            "cpu": _cpu_name(),
            "cores": cores(),
            "l3_bytes": _l3_bytes(),
            "python": platform.python_version(),
            "jax": jax.__version__,
        },
        "model": {
            "path": str(path),
            "dtype": str(jnp.dtype(args.dtype)),
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
    # timed before, it left what the cold plan's compiling kept resident (28 MiB for SmolLM2)
    # under the plan that the cell then ran on, as in no process that compiles once.
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


# Printing.


def _fmt(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _cell_line(r: dict) -> str:
    j = r["jaxlm"]
    return (
        f"[bench] batch {r['batch']}, prompt {r['prompt_len']}, new {r['new_tokens']}: "
        f"prefill {_fmt(j['prefill_tok_s'])} tok/s, decode {_fmt(j['decode_tok_s'])} tok/s"
    )


def text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """The lines of a right-aligned text table with a rule under `header`."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return lines


def format_report(report: dict) -> str:
    """The benchmark's results as text tables."""
    from jaxlm.memory import format_bytes

    mib = 2**20
    m, bw = report["model"], report["bandwidth"]
    lines = [
        f"model {m['path']} ({m['dtype']}, {m['parameters'] / 1e6:.3g}M parameters, "
        f"weights {format_bytes(m['weights_bytes'])}, loaded in {m['load_s']:.1f} s)",
        f"machine {report['machine']['cpu']}, {report['machine']['cores']} cores; "
        f"memory read bandwidth {bw['bytes_per_s'] / 2**30:.1f} GiB/s "
        f"(numpy {bw['numpy_bytes_per_s'] / 2**30:.1f}, XLA {bw['xla_bytes_per_s'] / 2**30:.1f}); "
        f"a decode step reading {format_bytes(m['weights_read_per_step_bytes'])} of weights "
        f"can run at most {bw['bytes_per_s'] / m['weights_read_per_step_bytes']:.1f} steps/s",
    ]
    l3 = report["machine"]["l3_bytes"]
    if l3 and m["weights_read_per_step_bytes"] <= l3:
        lines.append(
            f"note: the weights fit in the {l3 / mib:.0f} MiB L3 cache, so decode may beat the "
            "DRAM bandwidth limit"
        )
    lines.append(
        f"medians of {report['settings']['repeats']} repeats; RSS "
        f"{report['baseline_rss_bytes'] / mib:.0f} MiB before loading, "
        f"{m['rss_after_load_bytes'] / mib:.0f} MiB after (peak "
        f"{m['peak_rss_while_loading_bytes'] / mib:.0f} MiB while loading)"
    )
    lines.append("")
    header = (
        "batch",
        "prompt",
        "new",
        "prefill tok/s",
        "TTFT ms",
        "decode tok/s",
        "per row",
        "of BW",
        "compile s",
        "cached s",
        "peak RSS MiB",
        "predicted MiB",
        "load",
    )
    rows = []
    for r in report["cells"]:
        j = r["jaxlm"]
        rows.append(
            (
                str(r["batch"]),
                str(r["prompt_len"]),
                str(r["new_tokens"]),
                _fmt(j["prefill_tok_s"]),
                _fmt(j["ttft_s"], scale=1e3),
                _fmt(j["decode_tok_s"]),
                _fmt(j["decode_tok_s_per_row"]),
                _fmt(j.get("bandwidth_fraction"), ".0%"),
                _fmt(j["first_call_cold_s"], ".2f"),
                _fmt(j["first_call_cached_s"], ".2f"),
                _fmt(j["peak_rss_bytes"], ".0f", 1 / mib),
                _fmt(j["predicted_peak_bytes"], ".0f", 1 / mib),
                _fmt(r["other_load_cores"], ".2f"),
            )
        )
    lines += text_table(header, rows)
    lines.append(
        "compile s / cached s: plan + first `generate` with an empty persistent compilation "
        "cache / after `jax.clear_caches()` with it filled; of BW: decode steps/s over "
        "bandwidth / weight bytes; load: cores busy with other processes while the cell ran; "
        "peak RSS: while the cell generated"
        + (
            ""
            if all(r["jaxlm"]["peak_rss_since"] == "generation" for r in report["cells"])
            else " (here: since the start, this system cannot reset it)"
        )
        + "; predicted: RSS before loading + the plan's whole bill + its compiled steps' "
        "host memory"
    )
    if report["settings"]["vs"]:
        lines.append("peak RSS includes the other engines' copies of the weights")
    comparisons = []
    for r in report["cells"]:
        for name, ratio in r["ratios"].items():
            o = r[name]
            comparisons.append(
                (
                    name,
                    str(r["batch"]),
                    str(r["prompt_len"]),
                    str(r["new_tokens"]),
                    _fmt(o["prefill_tok_s"]),
                    _fmt(o["decode_tok_s"]),
                    _ratio(ratio["prefill_tok_s"]),
                    _ratio(ratio["decode_tok_s"]),
                    str(ratio["same_tokens"]),
                )
            )
    if comparisons:
        header = (
            "engine",
            "batch",
            "prompt",
            "new",
            "prefill tok/s",
            "decode tok/s",
            "jaxlm/it prefill",
            "jaxlm/it decode",
            "same tokens",
        )
        lines += ["", *text_table(header, comparisons)]
        lines.append(
            "ratios: the median [and each repeat's pair]; same tokens: leading greedy tokens of "
            "row 0 that agree with jaxlm"
        )
    for name, reason in report["skipped"].items():
        lines.append(f"{name}: {reason}")
    return "\n".join(lines)


def _ratio(r: dict) -> str:
    pairs = ", ".join(_fmt(p, ".2f") for p in r["pairs"])
    return f"{_fmt(r['median'], '.2f')}x [{pairs}]"
