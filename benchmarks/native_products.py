"""The quantized products of a SmolLM2-sized step: XLA's against jaxlm's native kernels.

Thirty layers of projections (q/k/v `[960, 576]`, o `[576, 576]`, gate/up `[3072, 576]`, down
`[576, 1536]`) and the LM head `[49152, 576]`, random weights, multiplied by `cols` columns of
activations, `--steps` steps in one jitted `fori_loop`, as a decode step (1 column), a batch
or a draft's verification (a few) and a prompt chunk (128) run them; the products go through
`jaxlm.ops` with the native kernels switched on and off (`JAXLM_NATIVE_KERNELS`):
- `float32`: `jaxlm.ops.matmul` of float32 weights;
- `int8 XLA` / `int8 native`: `jaxlm.ops.quantize_weight`'s int8 rows;
- `int4 XLA` / `int4 native`: `jaxlm.kernels.int4` blocks (XLA multiplies a float32 copy).
The table gives milliseconds per step (median of `--repeats`), the stored weight bytes, XLA's
temporaries, where a copy of the weights hoisted out of the loop shows, and the cores other
processes kept busy meanwhile (`load`: above about 0.1, measure again).

`--isa` runs the native kernels on a path below the best this CPU has (`jaxlm.kernels.ISAS`).

Usage: python benchmarks/native_products.py [--cols 1,2,8,128] [--steps 8] [--repeats 3]
       [--layers 30] [--vocab 49152] [--isa avx2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import kernels, ops
from jaxlm.bench import text_table
from jaxlm.bench.system import OtherLoad
from jaxlm.kernels import int4

H, INTER = 576, 1536
SHAPES = ((960, H), (H, H), (2 * INTER, H), (H, INTER))
VARIANTS = ("float32", "int8 XLA", "int8 native", "int4 XLA", "int4 native")


def weights(variant: str, layers: int, vocab: int, rng) -> list:
    store = {
        "float32": lambda w: (w,),
        "int8": jax.jit(ops.quantize_weight),
        "int4": jax.jit(int4.quantize),
    }[variant.split()[0]]
    shapes = [s for _ in range(layers) for s in SHAPES] + [(vocab, H)]
    return [store(jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)) for s in shapes]


def product(w: tuple, x: jax.Array) -> jax.Array:
    return ops.matmul(w[0], x) if len(w) == 1 else ops.quantized_matmul(*w, x)


def make_steps(steps: int):
    def run(ws, x):
        def step(_, x):
            *layers, head = ws
            for i in range(0, len(layers), len(SHAPES)):
                qkv, o, gate_up, down = layers[i : i + len(SHAPES)]
                x = x + 1e-3 * product(qkv, x)[:H]
                x = x + 1e-3 * product(o, x)
                g = product(gate_up, x)
                x = x + 1e-3 * product(down, g[:INTER] * g[INTER:])
            return x + 1e-6 * product(head, x)[:H]

        return jax.lax.fori_loop(0, steps, step, x)

    return run


def measure(variant: str, ws: list, cols: int, args) -> tuple[float, int, float]:
    os.environ[kernels.SWITCH] = "1" if variant.endswith("native") or variant == "float32" else "0"
    x = jnp.full((H, cols), 0.1, jnp.float32)
    # A function of its own per variant: `jax.jit` keeps the traces of one it has seen.
    run = make_steps(args.steps)
    compiled = jax.jit(lambda ws, x: run(ws, x)).lower(ws, x).compile()
    compiled(ws, x).block_until_ready()
    times = []
    with OtherLoad() as load:
        for _ in range(args.repeats):
            start = time.perf_counter()
            compiled(ws, x).block_until_ready()
            times.append((time.perf_counter() - start) / args.steps)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return float(np.median(times)) * 1e3, temp, load.cores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cols", default="1,2,8,128")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--isa", choices=kernels.ISAS, help="the native kernels' path")
    args = p.parse_args(argv)
    native = kernels.available()
    with kernels.limited_to(args.isa) if args.isa and native else contextlib.nullcontext():
        print(f"native kernels: {kernels.isa() if native else 'unavailable'}", flush=True)
        rows = table(args, native)
    header = ("products", "columns", "stored MiB", "XLA temp MiB", "ms/step", "load")
    print("\n".join(text_table(header, rows)))
    return 0


def table(args, native: bool) -> list[tuple]:
    cols = [int(c) for c in args.cols.split(",")]
    rows, rng = [], np.random.default_rng(0)
    for variant in VARIANTS:
        if variant.endswith("native") and not native:
            continue
        ws = weights(variant, args.layers, args.vocab, rng)
        stored = sum(a.nbytes for w in ws for a in w)
        for c in cols:
            ms, temp, load = measure(variant, ws, c, args)
            mib = f"{stored / 2**20:.0f}", f"{temp / 2**20:.1f}"
            rows.append((variant, str(c), *mib, f"{ms:.2f}", f"{load:.1f}"))
            print(*rows[-1], sep="\t", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
