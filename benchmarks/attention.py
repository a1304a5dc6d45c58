"""A decode step's attention over the KV pages: XLA's against jaxlm's native kernel.

`jaxlm.ops.attend_paged` as a SmolLM2-sized layer runs it (9 query heads and 3 KV heads of 64
features), `--layers` layers chained in one jitted call, with the native kernels switched off
(`JAXLM_NATIVE_KERNELS=0`: XLA gathers the pages and runs the softmax) and on
(`jaxlm.kernels.attend`), alternated call by call. Each case is rows x queries per row (1: a
decode token, 4: a token and 3 drafts), pages x slots per page (128: `generate`'s pages, 16:
the engine's) and the slots in use. The table gives microseconds per layer (median of
`--repeats` alternated calls) and the cores other processes kept busy meanwhile (`load`).

Usage: python benchmarks/attention.py [--repeats 7] [--layers 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import kernels
from jaxlm.bench import text_table
from jaxlm.bench.system import OtherLoad
from jaxlm.ops.attention import attend_paged

HEADS, KV_HEADS, DIM = 9, 3, 64
# (rows, queries per row, pages per row, slots per page, slots in use)
CASES = (
    (1, 1, 2, 128, 192),
    (1, 1, 16, 16, 192),
    (1, 4, 16, 16, 192),
    (8, 1, 2, 128, 192),
    (8, 1, 64, 16, 600),
)


def inputs(rows, width, per_row, size, used, rng) -> tuple:
    pages = rows * per_row + 1
    q = jnp.asarray(rng.standard_normal((HEADS, DIM, rows, width)), jnp.float32)
    cache = {
        "k_pages": jnp.asarray(rng.standard_normal((pages, KV_HEADS, DIM, size)), jnp.float32),
        "v_pages": jnp.asarray(rng.standard_normal((pages, KV_HEADS, size, DIM)), jnp.float32),
    }
    table = jnp.arange(rows * per_row, dtype=jnp.int32).reshape(rows, per_row)
    mask = jnp.broadcast_to(jnp.arange(per_row * size) < used, (rows, width, per_row * size))
    return q, cache, table, mask, jnp.int32(used)


def compiled(native: bool, args: tuple, layers: int):
    os.environ[kernels.SWITCH] = "1" if native else "0"

    # A function of its own per variant: `jax.jit` keeps the traces of one it has seen.
    def chain(q, cache, table, mask, end):
        for _ in range(layers):
            q = q + 1e-3 * attend_paged(q, cache, table, mask, end).reshape(q.shape)
        return q

    return jax.jit(chain).lower(*args).compile()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args(argv)
    if not kernels.runs_here():
        print("the native kernels do not run here", file=sys.stderr)
        return 1
    rows, rng = [], np.random.default_rng(0)
    for case in CASES:
        x = inputs(*case, rng)
        fns = {native: compiled(native, x, args.layers) for native in (False, True)}
        times = {native: [] for native in fns}
        with OtherLoad() as load:
            for _ in range(args.repeats):
                for native, fn in fns.items():
                    start = time.perf_counter()
                    fn(*x).block_until_ready()
                    times[native].append((time.perf_counter() - start) / args.layers * 1e6)
        xla, native = (float(np.median(times[n])) for n in (False, True))
        name = f"{case[0]} x {case[1]}, {case[2]} x {case[3]}, {case[4]}"
        rows.append(
            (name, f"{xla:.1f}", f"{native:.1f}", f"{xla / native:.2f}", f"{load.cores:.1f}")
        )
    os.environ.pop(kernels.SWITCH)
    header = ("rows x queries, pages x slots, in use", "XLA us", "kernel us", "ratio", "load")
    print("\n".join(text_table(header, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
