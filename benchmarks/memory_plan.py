"""Decode-step time and memory against the size of the KV cache, donated and not.

For each cache size a child process builds the model (random weights of the model's config: the
timings do not depend on the values), makes a plan of one row whose `max_seq_len` gives that
cache, and then:
1. runs the plan's donated decode step (`generator.decode_step`) and the same step jitted without
   donation, timing each;
2. records the process's resident memory around each phase: the peak growth while the steps run
   against what XLA's memory analysis of that step predicts, and the whole process's peak growth
   (compilation included) against the plan's whole bill;
3. runs a `generate` of one prefill chunk and two new tokens with the plan, whose peak growth is
   compared with the plan's bill less the weights (already resident).

Children run with `MALLOC_MMAP_THRESHOLD_` set so that glibc returns every large buffer to the
system when it is freed and RSS follows the live bytes.

Usage: python benchmarks/memory_plan.py [--quick] [--sizes 64,256,1024] [--model PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jaxlm.bench import current_rss, peak_rss, reset_peak_rss

DEFAULT_SIZES_MIB = (64, 128, 256, 512, 1024, 2048)
QUICK_SIZES_MIB = (64, 512)
MIB = 2**20


def _time_steps(step, scratch, tokens, steps: int, budget_s: float):
    """Median seconds of `step`, run at most `steps` times and for about `budget_s` at most."""
    import jax

    times = []
    start = time.perf_counter()
    while len(times) < steps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        scratch, logits = step(scratch, tokens)
        jax.block_until_ready((scratch, logits))
        times.append(time.perf_counter() - t)
    return statistics.median(times), len(times), scratch


def measure(
    model_path: str | None,
    kv_bytes: int,
    *,
    dtype: str = "float32",
    steps: int = 20,
    budget_s: float = 5.0,
) -> dict:
    """Measure one cache size in this process; run it in a fresh process for clean RSS figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxlm
    from jaxlm.bench import OtherLoad
    from jaxlm.loading import default_model_path, open_checkpoint
    from jaxlm.memory import ExecutableMemory

    jax.devices()
    baseline = current_rss()
    path = Path(model_path) if model_path else default_model_path()
    config = jaxlm.ModelConfig.from_hf_config(open_checkpoint(path).config)
    model = jaxlm.LlamaForCausalLM(config, dtype=jnp.dtype(dtype))
    jax.block_until_ready(nnx.state(model))
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    seq = max(32, kv_bytes // (per_slot * jnp.dtype(dtype).itemsize))
    t = time.perf_counter()
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=int(seq))
    plan_s = time.perf_counter() - t
    generator = plan.generator
    params = generator.params
    abstract = (
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
        plan.layout.abstract(),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    plain_jit = jax.jit(generator.decode_step.__wrapped__, keep_unused=True)
    donated = generator.decode_step.lower(*abstract).compile()
    plain = plain_jit.lower(*abstract).compile()
    memory = {
        "donated": ExecutableMemory.of("donated", donated),
        "plain": ExecutableMemory.of("plain", plain),
    }
    weights = plan.weights_bytes
    tokens = np.zeros((1,), np.int32)
    out = {
        "kv_cache_bytes": plan.kv_cache_bytes,
        "max_seq_len": plan.max_seq_len,
        "weights_bytes": weights,
        "scratch_bytes": plan.scratch_bytes,
        "plan_total_bytes": plan.total_bytes,
        "plan_s": plan_s,
    }
    # A prompt of one prefill chunk runs the very executable the plan compiled and accounted for.
    n = min(plan.prefill_chunk, plan.max_seq_len - 2)
    prompt = [1 + i % (config.vocab_size - 1) for i in range(n)]
    # A first run of everything compiles the small executables (zero fills, transfers) outside
    # the measured phases; taking the scratch back leaves the plan's pool empty.
    jaxlm.generate(model, None, prompt, max_new_tokens=2, stop_token_ids=[], plan=plan)
    plan.take()
    scratch = plan.allocate()
    del scratch
    for name, compiled in (("donated", donated), ("plain", plain)):
        gc.collect()
        ready = current_rss()
        reset_peak_rss()
        scratch = plan.allocate()
        with OtherLoad() as load:
            step_s, n, scratch = _time_steps(
                lambda s, x, c=compiled: c(params, s, x), scratch, tokens, steps, budget_s
            )
        out[f"{name}_other_load_cores"] = load.cores
        out[f"{name}_step_s"] = step_s
        out[f"{name}_steps"] = n
        out[f"{name}_measured_bytes"] = peak_rss() - ready
        # The step's arguments include the weights, which were resident before it ran.
        out[f"{name}_predicted_bytes"] = memory[name].peak - weights
        del scratch
    gc.collect()
    ready = current_rss()
    reset_peak_rss()
    jaxlm.generate(model, None, prompt, max_new_tokens=2, stop_token_ids=[], plan=plan)
    out["generate_measured_bytes"] = peak_rss() - ready
    out["generate_predicted_bytes"] = plan.total_bytes - weights
    out["process_peak_growth_bytes"] = _ru_maxrss() - baseline
    out["baseline_rss_bytes"] = baseline
    return out


def _ru_maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_in_child(model_path: str | None, kv_bytes: int, **kw) -> dict:
    """`measure` in a fresh Python process."""
    request = json.dumps({"model_path": model_path, "kv_bytes": kv_bytes, **kw})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", request],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the child for {kv_bytes} bytes failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    """The measurements as a text table."""

    def mib(n):
        return f"{n / MIB:.0f}" if abs(n) >= 10 * MIB else f"{n / MIB:.2f}"

    def pair(r, name):
        return f"{mib(r[f'{name}_predicted_bytes'])} / {mib(r[f'{name}_measured_bytes'])}"

    header = (
        "KV cache MiB",
        "max_seq_len",
        "donated ms",
        "not donated ms",
        "slowdown",
        "donated MiB pred/meas",
        "not donated MiB pred/meas",
        "generate MiB pred/meas",
        "bill MiB",
        "process peak MiB",
        "load",
    )
    body = [
        (
            mib(r["kv_cache_bytes"]),
            str(r["max_seq_len"]),
            f"{r['donated_step_s'] * 1e3:.2f}",
            f"{r['plain_step_s'] * 1e3:.2f}",
            f"{r['plain_step_s'] / r['donated_step_s']:.1f}x",
            pair(r, "donated"),
            pair(r, "plain"),
            pair(r, "generate"),
            mib(r["plan_total_bytes"]),
            mib(r["process_peak_growth_bytes"]),
            f"{max(r['donated_other_load_cores'], r['plain_other_load_cores']):.2f}",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    lines += [
        "",
        "ms: median time of one decode step (batch 1), with the scratch donated and without.",
        "pred/meas: XLA's peak for the step (arguments + outputs - aliased + temporaries) less "
        "the resident weights, against the growth of the process's peak RSS while it ran;",
        "generate: the plan's whole bill less the weights, against a `generate` of one prefill "
        "chunk and 2 new tokens.",
        "bill: the plan's whole bill; process peak: peak RSS growth of the process since start, "
        "compilation included;",
        "load: cores busy with other processes while the steps were timed (the larger of the two).",
    ]
    return "\n".join(lines)


def _sizes(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def main(argv: list[str] | None = None) -> int:
    """Run every size in its own process and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--sizes", type=_sizes, default=None, help="KV cache sizes in MiB")
    p.add_argument("--steps", type=int, default=20, help="decode steps per variant (at most)")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES_MIB}, 5 steps")
    p.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(**json.loads(args.child))))
        return 0
    sizes = args.sizes or (QUICK_SIZES_MIB if args.quick else DEFAULT_SIZES_MIB)
    steps = 5 if args.quick else args.steps
    rows = []
    for size in sizes:
        rows.append(measure_in_child(args.model, int(size * MIB), dtype=args.dtype, steps=steps))
        r = rows[-1]
        print(
            f"[memory_plan] {size:g} MiB: donated {r['donated_step_s'] * 1e3:.2f} ms, "
            f"not donated {r['plain_step_s'] * 1e3:.2f} ms",
            file=sys.stderr,
            flush=True,
        )
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
