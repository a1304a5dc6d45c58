"""The two variants of `jaxlm.ops.expert_products` (a mixture-of-experts layer) side by side:
the chosen experts sliced out and multiplied, and every expert multiplied with the unchosen
weighed by zero. One jitted call on random weights, stored as `jaxlm.ops.expert_storage`
stores them; the medians of 5 calls after one that compiles.

Usage: python benchmarks/expert_products.py DTYPE TOKENS EXPERTS,TOP_K,HIDDEN,INTER
    e.g. python benchmarks/expert_products.py bfloat16 1,2,4,8 128,8,1024,384
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import ops


def main(dtype: str, tokens: str, shape: str) -> None:
    experts, top_k, hidden, inter = map(int, shape.split(","))
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(0)

    def weights(*shape):
        w = jnp.asarray(0.02 * rng.standard_normal(shape, np.float32), dtype)
        return ops.expert_storage(w)

    gate_up, down = weights(experts, 2 * inter, hidden), weights(experts, hidden, inter)
    for n in map(int, tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((hidden, n), np.float32))
        chosen = [rng.choice(experts, top_k, replace=False) for _ in range(n)]
        index = jnp.asarray(np.stack(chosen), jnp.int32)
        weight = jnp.full((n, top_k), 1.0 / top_k, jnp.float32)
        times = []
        # A share of infinity always gathers, 0 never does.
        for share in (float("inf"), 0.0):
            ops._GATHERED_SHARE = share
            f = jax.jit(lambda *a: ops.expert_products(*a, jax.nn.silu, dtype))
            args = (x, gate_up, down, index, weight)
            f(*args).block_until_ready()
            runs = []
            for _ in range(5):
                start = time.perf_counter()
                f(*args).block_until_ready()
                runs.append(time.perf_counter() - start)
            times.append(1000 * float(np.median(runs)))
        print(
            f"{dtype.name} {experts} experts, top-{top_k}, {n} tokens: "
            f"gathered {times[0]:.1f} ms, dense {times[1]:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
