"""How much 8-bit products change the model: next-token distributions against float32.

Every product of the model (q/k/v, o, gate/up, down, the LM head) is replaced by one that
rounds its weight and its activations to int8 as a scheme would, computed in float32 (simulated
quantization: only the rounding differs from the float32 model, which equals transformers).
Over a fixed text of prose, code and arithmetic, it prints each scheme's mean KL divergence
from float32's next-token distribution and how often both pick the same top token. The schemes:
- `rows / tokens`: one scale per weight row, one per activation column (token);
- `rows / tokens, rotated`: the same after an orthogonal rotation of the features (random
  signs, then a Hadamard transform in blocks of 64), applied to the activations and folded
  into the weights, which spreads outlier features over their block (as QuaRot does);
- `blocks of 32`: weights and activations in blocks of 32 along the features, as llama.cpp's
  `Q8_0` stores both;
- `rows / blocks of 32`: one scale per weight row, activations in blocks of 32.

Usage: python benchmarks/int8_quality.py [--model PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlm
from jaxlm import ops
from jaxlm.bench import text_table

TEXT = """\
The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night,
its keeper climbed the narrow stairs, trimmed the wick and watched the ships pass in the dark.
When the storm came in November, the waves rose higher than anyone in the village remembered,
and the light was the only thing that did not move.

def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

Question: A train leaves at 9:15 and arrives at 11:40. How long is the journey?
Answer: From 9:15 to 11:15 is 2 hours, and from 11:15 to 11:40 is 25 minutes, so the journey
takes 2 hours and 25 minutes. If the ticket costs 18 euros and a return costs 1.5 times as
much, the return ticket costs 27 euros.

Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. The reaction
happens in the chloroplasts, where chlorophyll absorbs mostly red and blue light and reflects
green, which is why leaves look green to us.

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id
GROUP BY name HAVING COUNT(*) > 3 ORDER BY orders DESC;

12 * 7 = 84, 144 / 12 = 12, 2 ** 10 = 1024, and the square root of 169 is 13.
"""
SCHEMES = ("rows / tokens", "rows / tokens, rotated", "blocks of 32", "rows / blocks of 32")
ROTATION_BLOCK = 64


def _rounded(a: jax.Array, axis: int) -> jax.Array:
    """`a` rounded to int8 with a symmetric scale over `axis`, back in float32."""
    scale = jnp.max(jnp.abs(a), axis=axis, keepdims=True) / 127
    scale = jnp.where(scale == 0, 1, scale)
    return jnp.clip(jnp.round(a / scale), -127, 127) * scale


def _in_blocks(a: jax.Array, axis: int, block: int) -> jax.Array:
    """`a` rounded in blocks of `block` along `axis` (the last block padded with zeros)."""
    a = jnp.moveaxis(a, axis, -1)
    n = a.shape[-1]
    padded = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -n % block)])
    blocks = _rounded(padded.reshape(*a.shape[:-1], -1, block), -1)
    return jnp.moveaxis(blocks.reshape(padded.shape)[..., :n], -1, axis)


def rotation(n: int, seed: int = 0) -> np.ndarray:
    """An orthogonal `[n, n]`: random signs, then a Hadamard transform in blocks of 64."""
    h = np.ones((1, 1))
    while h.shape[0] < ROTATION_BLOCK:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(ROTATION_BLOCK)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], n)
    return (np.kron(np.eye(n // ROTATION_BLOCK), h) * signs[None, :]).astype(np.float32)


def simulated(scheme: str):
    """A stand-in for `jaxlm.ops.matmul` that rounds as `scheme` does."""
    rotations: dict[int, jax.Array] = {}

    def matmul(w, x):
        w = w.astype(jnp.float32)
        k = w.shape[-1]
        flat = x.reshape(k, -1).astype(jnp.float32)
        if scheme == "rows / tokens, rotated" and k % ROTATION_BLOCK == 0:
            r = rotations.setdefault(k, jnp.asarray(rotation(k)))
            w, flat = w @ r.T, r @ flat
        w = _rounded(w, -1) if scheme.startswith("rows") else _in_blocks(w, -1, 32)
        flat = _in_blocks(flat, 0, 32) if scheme.endswith("blocks of 32") else _rounded(flat, 0)
        y = jnp.einsum("...ok,kc->...oc", w, flat)
        return y.reshape(*w.shape[:-1], *x.shape[1:])

    return matmul


def divergence(reference: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """Mean KL(reference || logits) over the positions, and the top-1 agreement."""

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref, got = log_softmax(reference), log_softmax(logits)
    kld = np.sum(np.exp(ref) * (ref - got), axis=-1)
    top = np.argmax(reference, -1) == np.argmax(logits, -1)
    return float(np.mean(kld)), float(np.mean(top))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    model, tokenizer = jaxlm.load(args.model, progress=False)
    ids = jnp.asarray([tokenizer.encode(TEXT)])
    graphdef, state = nnx.split(model)

    def logits() -> np.ndarray:
        # Traced anew for each scheme, so that the model calls the `ops.matmul` of the moment.
        forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)[0])
        return np.asarray(forward(state, ids))

    reference = logits()
    results, rows = [], []
    original = ops.matmul
    try:
        for scheme in SCHEMES:
            ops.matmul = simulated(scheme)
            kld, top1 = divergence(reference, logits())
            results.append(dict(scheme=scheme, mean_kld=kld, top1=top1))
            rows.append((scheme, f"{kld:.4f}", f"{100 * top1:.1f}%"))
    finally:
        ops.matmul = original
    print(f"{ids.shape[1]} tokens, against float32")
    print("\n".join(text_table(("scheme", "mean KLD", "top-1"), rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(dict(tokens=int(ids.shape[1]), results=results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
