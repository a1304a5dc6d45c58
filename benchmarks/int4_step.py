"""Whether XLA:CPU keeps 4-bit weights in 4 bits through a decode loop.

Thirty int8 or `jnp.int4` weights `[6144, 576]` (SmolLM2's gate/up width) multiply int8
activations of two columns in a jitted `fori_loop`, as a decode step's products would:
- `int8`: the int8 weights in an `s8 x s8 -> s32` dot;
- `int4, to int8 in the loop`: each 4-bit weight converted to int8 inside the loop body;
- `int4 in the dot`: the 4-bit weights given to the dot as they are.
The table gives the stored bytes, XLA's temporaries (a copy of the weights hoisted out of the
loop shows there) and the milliseconds per step.

Usage: python benchmarks/int4_step.py [--steps 16]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.bench import text_table

LAYERS, OUT, IN, COLS = 30, 6144, 576, 2


def make_step(convert: bool, steps: int):
    def run(weights, x):
        def step(_, x):
            for w in weights:
                xq = jnp.round(x * 10).astype(jnp.int8)
                w = w.astype(jnp.int8) if convert else w
                dims = (((1,), (0,)), ((), ()))
                y = jax.lax.dot_general(w, xq, dims, preferred_element_type=jnp.int32)
                x = x + 1e-6 * y[:IN].astype(jnp.float32)
            return x

        return jax.lax.fori_loop(0, steps, step, x)

    return jax.jit(run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    int8 = [jnp.asarray(rng.integers(-7, 8, (OUT, IN)), jnp.int8) for _ in range(LAYERS)]
    int4 = [w.astype(jnp.int4) for w in int8]
    x = jnp.asarray(rng.standard_normal((IN, COLS)), jnp.float32)
    rows = []
    variants = (("int8", int8, False), ("int4, to int8 in the loop", int4, True))
    for name, weights, convert in (*variants, ("int4 in the dot", int4, False)):
        compiled = make_step(convert, args.steps).lower(weights, x).compile()
        compiled(weights, x).block_until_ready()
        start = time.perf_counter()
        compiled(weights, x).block_until_ready()
        ms = (time.perf_counter() - start) / args.steps * 1e3
        stored = LAYERS * OUT * IN * (0.5 if weights[0].dtype == jnp.int4 else 1)
        temp = compiled.memory_analysis().temp_size_in_bytes
        rows.append((name, f"{stored / 2**20:.0f}", f"{temp / 2**20:.1f}", f"{ms:.1f}"))
    print("\n".join(text_table(("weights", "stored MiB", "XLA temp MiB", "ms/step"), rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
