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

Then `jaxlm int8`, the model `jaxlm.load(..., quantize="int8")` gives, and with `--vs
llama.cpp` (a GGUF model and llama-cpp-python installed), llama.cpp's own: its `Q8_0` copy of
the file (`convert_gguf.py q8_0`) and the file itself, each against llama.cpp's F32 copy, over
the same tokens: the bar jaxlm's int8 is held to.

Usage: python benchmarks/int8_quality.py [--model PATH] [--vs llama.cpp] [--json PATH]
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
from jaxlm.bench.quality import QUALITY_TEXT, divergence

SCHEMES = (
    "rows / tokens",
    "rows / tokens, rotated",
    "rows / digits",
    "rows / digits, rotated",
    "rows / digits, rotated but the head",
    "blocks of 32",
    "rows / blocks of 32",
)
ROTATION_BLOCK = 64


def _rounded(a: jax.Array, axis: int) -> jax.Array:
    """`a` rounded to int8 with a symmetric scale over `axis`, back in float32."""
    scale = jnp.max(jnp.abs(a), axis=axis, keepdims=True) / 127
    scale = jnp.where(scale == 0, 1, scale)
    return jnp.clip(jnp.round(a / scale), -127, 127) * scale


def _digits(a: jax.Array) -> jax.Array:
    """`a` `[features, cols]` as two int8 digits per value with a scale per column: the first
    rounds `a` to int8, the second its remainder at 1/254 of the first's step."""
    scale = jnp.max(jnp.abs(a), axis=0, keepdims=True) / 127
    scale = jnp.where(scale == 0, 1, scale)
    hi = jnp.round(a / scale)
    lo = jnp.clip(jnp.round((a - hi * scale) / (scale / 254)), -127, 127)
    return hi * scale + lo * (scale / 254)


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
        head = w.shape[-2] > 16 * k
        rotate = "rotated" in scheme and not (head and scheme.endswith("head"))
        if rotate and k % ROTATION_BLOCK == 0:
            r = rotations.setdefault(k, jnp.asarray(rotation(k)))
            w, flat = w @ r.T, r @ flat
        w = _rounded(w, -1) if scheme.startswith("rows") else _in_blocks(w, -1, 32)
        if scheme.endswith("blocks of 32"):
            flat = _in_blocks(flat, 0, 32)
        elif "digits" in scheme:
            flat = _digits(flat)
        else:
            flat = _rounded(flat, 0)
        y = jnp.einsum("...ok,kc->...oc", w, flat)
        return y.reshape(*w.shape[:-1], *x.shape[1:])

    return matmul


def llama_cpp_divergences(model, ids: list[int]) -> dict[str, tuple[float, float]]:
    """llama.cpp's `Q8_0` copy of the GGUF `model` and the file itself, each against its F32
    copy: mean KLD and top-1 over `ids`."""
    import tempfile

    from convert_gguf import convert

    from jaxlm.loading import default_model_path

    source = Path(model) if model else default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        copies = {kind: Path(tmp) / f"{kind}.gguf" for kind in ("f32", "q8_0")}
        for kind, path in copies.items():
            convert(source, path, kind)
        logits = {kind: llama_cpp_logits(path, ids) for kind, path in copies.items()}
    logits["file"] = llama_cpp_logits(source, ids)
    return {
        "llama.cpp Q8_0": divergence(logits["f32"], logits["q8_0"]),
        f"llama.cpp {source.name}": divergence(logits["f32"], logits["file"]),
    }


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits `[len(ids), vocab]` for every position of `ids`."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=len(ids) + 8, n_batch=512, logits_all=True, verbose=False
    )
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], np.float32)
    llm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--vs", action="append", default=[], choices=["llama.cpp"])
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    model, tokenizer = jaxlm.load(args.model, progress=False)
    ids = jnp.asarray([tokenizer.encode(QUALITY_TEXT)])
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
    quantized = jaxlm.load(args.model, progress=False, quantize="int8")[0]
    measured = {"jaxlm int8": divergence(reference, np.asarray(quantized(ids)[0]))}
    if "llama.cpp" in args.vs:
        measured.update(llama_cpp_divergences(args.model, ids[0].tolist()))
    for scheme, (kld, top1) in measured.items():
        results.append(dict(scheme=scheme, mean_kld=kld, top1=top1))
        rows.append((scheme, f"{kld:.4f}", f"{100 * top1:.1f}%"))
    print(f"{ids.shape[1]} tokens, against float32")
    print("\n".join(text_table(("scheme", "mean KLD", "top-1"), rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(dict(tokens=int(ids.shape[1]), results=results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
