"""8-bit products of a decode step alone: int8 weights and activations against float weights.

Every projection of every layer and the LM head of the model run on `rows` activation columns
(feature-major, as jaxlm runs them) in a jitted `fori_loop` of `--steps` steps, nothing else.
The variants:
- `float32`, `bfloat16`: `jaxlm.ops.matmul` on float weights;
- `int8 rows`: weights in int8 with one scale per output row, activations quantized to int8
  with one scale per column (token), an `s8 x s8 -> s32` dot, rescaled in float32;
- `int8 blocks`: weights and activations in blocks of 32 along the input, as llama.cpp's Q8_0
  stores both: a batched `s8 x s8 -> s32` dot over the blocks, then the partial sums scaled
  and added;
- `jaxlm int8`: the library's product (`jaxlm.ops.quantized_matmul`): weights per row after a
  rotation of their input, activations rotated and rounded to two int8 digits per value.

XLA:CPU's dot library declines integer products with one column, so one column is padded to
two. The table gives each variant's median milliseconds per step, the weight bytes one step
reads over that time, and XLA's temporaries (a hoisted copy of the weights shows there).

Usage: python benchmarks/int8_step.py [--model PATH] [--rows 1,2,8] [--steps 16] [--rounds 5]
    [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from matmul_step import layer_weights

from jaxlm import ops
from jaxlm.bench import OtherLoad, text_table
from jaxlm.ops import matmul

VARIANTS = ("float32", "bfloat16", "int8 rows", "int8 blocks", "jaxlm int8")
BLOCK = 32


def _quantize(a: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """`a` as int8 and the float32 scales over `axis` (symmetric, round to nearest)."""
    scale = jnp.max(jnp.abs(a), axis=axis, keepdims=True) / 127
    q = jnp.round(a / jnp.where(scale == 0, 1, scale)).astype(jnp.int8)
    return q, jnp.squeeze(scale, axis)


def quantize_weight(w: jax.Array, variant: str):
    """A weight `[out, in]` as the variant stores it."""
    if variant == "float32":
        return w.astype(jnp.float32)
    if variant == "bfloat16":
        return w.astype(jnp.bfloat16)
    if variant == "jaxlm int8":
        return ops.quantize_weight(w)
    w = w.astype(jnp.float32)
    if variant == "int8 rows":
        return _quantize(w, 1)
    # An input not a multiple of the block is padded with zeros (a tiny model's).
    w = jnp.pad(w, ((0, 0), (0, -w.shape[1] % BLOCK)))
    out, k = w.shape
    q, s = _quantize(w.reshape(out, k // BLOCK, BLOCK), 2)
    # [blocks, out, 32] and [blocks, out]: the blocks lead, as the dot's batch.
    return q.transpose(1, 0, 2), s.T


def product(w, x: jax.Array, variant: str) -> jax.Array:
    """`w @ x` for a weight stored by `quantize_weight` and `x` `[in, cols]`: `[out, cols]`."""
    if variant in ("float32", "bfloat16"):
        return matmul(w, x)
    if variant == "jaxlm int8":
        return ops.quantized_matmul(*w, x)
    cols = x.shape[1]
    if cols == 1:
        x = jnp.pad(x, ((0, 0), (0, 1)))
    q, s = w
    if variant == "int8 rows":
        xq, xs = _quantize(x, 0)
        dims = (((1,), (0,)), ((), ()))
        acc = jax.lax.dot_general(q, xq, dims, preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * s[:, None] * xs[None, :]
    else:
        x = jnp.pad(x, ((0, -x.shape[0] % BLOCK), (0, 0)))
        xq, xs = _quantize(x.reshape(-1, BLOCK, x.shape[1]), 1)
        dims = (((2,), (1,)), ((0,), (0,)))
        acc = jax.lax.dot_general(q, xq, dims, preferred_element_type=jnp.int32)
        y = jnp.sum(acc.astype(jnp.float32) * s[:, :, None] * xs[:, None, :], axis=0)
    return y[:, :cols]


def make_step(variant: str, steps: int):
    def layer(x, ws):
        q, k, v = (product(ws[n], x, variant) for n in ("q", "k", "v"))
        # Keys and values feed the output so that XLA keeps their products.
        a = q + 1e-9 * (k.sum(0, keepdims=True) + v.sum(0, keepdims=True))
        x = x + product(ws["o"], a, variant)
        gate, up = product(ws["gate"], x, variant), product(ws["up"], x, variant)
        x = x + product(ws["down"], jax.nn.silu(gate) * up, variant)
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=0, keepdims=True) + 1e-5)

    def run(layers, head, x):
        def step(_, x):
            for ws in layers:
                x = layer(x, ws)
            return x + 1e-9 * product(head, x, variant).sum(0, keepdims=True)

        return jax.lax.fori_loop(0, steps, step, x)

    return jax.jit(run)


def main(argv: list[str] | None = None) -> int:
    import jaxlm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rows", default="1,2,8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    model, _ = jaxlm.load(args.model, progress=False)
    layers, head = layer_weights(model)
    del model
    weights = {
        v: (
            [{n: quantize_weight(w, v) for n, w in ws.items()} for ws in layers],
            quantize_weight(head, v),
        )
        for v in VARIANTS
    }
    hidden = head.shape[1]
    rng = np.random.default_rng(0)
    busy = 0.0
    rows_out, results = [], []
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((hidden, rows), np.float32))
        steps = {v: make_step(v, args.steps) for v in VARIANTS}
        compiled = {v: steps[v].lower(*weights[v], x).compile() for v in VARIANTS}
        reference = np.asarray(compiled["float32"](*weights["float32"], x))
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        diffs = {}
        for v in VARIANTS:
            diffs[v] = float(np.max(np.abs(np.asarray(compiled[v](*weights[v], x)) - reference)))
        with OtherLoad() as load:
            for _ in range(args.rounds):
                for v in VARIANTS:
                    start = time.perf_counter()
                    compiled[v](*weights[v], x).block_until_ready()
                    times[v].append((time.perf_counter() - start) / args.steps * 1e3)
        busy = max(busy, load.cores)
        for v in VARIANTS:
            nbytes = sum(a.nbytes for a in jax.tree.leaves(weights[v]))
            ms = statistics.median(times[v])
            temp = compiled[v].memory_analysis().temp_size_in_bytes
            results.append(
                dict(
                    rows=rows,
                    variant=v,
                    median_ms=ms,
                    weight_bytes=nbytes,
                    temp_bytes=temp,
                    max_abs_diff=diffs[v],
                )
            )
            rows_out.append(
                (
                    str(rows),
                    v,
                    f"{ms:.2f}",
                    f"{nbytes / ms / 1e6:.1f}",
                    f"{temp / 2**20:.1f}",
                    f"{diffs[v]:.3g}",
                )
            )
    header = ("rows", "variant", "ms/step", "GB/s", "XLA temp MiB", "max diff vs f32")
    print("\n".join(text_table(header, rows_out)))
    print(f"load: {busy:.2f} cores kept busy by other processes (above 0.1: measure again)")
    if args.json is not None:
        args.json.write_text(json.dumps(dict(results=results, load=busy), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
