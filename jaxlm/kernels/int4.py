"""The 4-bit weight format of `jaxlm.quantize(model, "int4")` and of GGUF's Q4_0 and Q4_1.

A weight `[..., out, in]` is stored in blocks of 32 along its input, as two arrays:
- `packed`, uint8 `[..., out, in / 2]`: block b of a row in bytes `16 b` to `16 b + 15`, byte
  i holding the block's element i in its low nibble and element i + 16 in its high one (GGUF's
  order), each a value q from 0 to 15;
- `scales`, float16 `[..., out, in / 32, 2]`: each block's scale `d` and minimum `m`.
Element `d * q + m`, computed in float32. A GGUF Q4_1 block is kept exactly; a Q4_0 block
`d * (q - 8)` too, with `m = -8 d` (exact in float16). One format for both keeps one kernel;
it costs Q4_0 files two bytes per block.

`matmul` and `rows` are the products and gathers XLA runs where the native kernels do not
(`jaxlm.kernels.w4_matmul`).
"""

from __future__ import annotations

import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
# The GGUF block types kept exactly, with the bytes of one block.
GGUF_TYPES = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`w` `[..., out, in]` (`in` a multiple of 32) as `(packed, scales)`: each block's minimum
    and step `(max - min) / 15` rounded to float16 first, then its values to the nearest step
    from that minimum, clipped to [0, 15] (GGUF's Q4_1, rounded with the stored scales)."""
    if w.ndim < 2 or w.shape[-1] % BLOCK:
        raise ValueError(f"`w` must be [..., out, in] with `in` a multiple of 32, got {w.shape}")
    blocks = w.astype(jnp.float32).reshape(*w.shape[:-1], -1, BLOCK)
    low, high = blocks.min(-1), blocks.max(-1)
    d = ((high - low) / 15).astype(jnp.float16)
    m = low.astype(jnp.float16)
    d32, m32 = d.astype(jnp.float32), m.astype(jnp.float32)
    step = jnp.where(d32 == 0, 1, d32)[..., None]
    q = jnp.clip(jnp.round((blocks - m32[..., None]) / step), 0, 15).astype(jnp.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(*w.shape[:-1], -1), jnp.stack([d, m], axis=-1)


def values(packed: jax.Array) -> jax.Array:
    """The 4-bit values q `[..., out, in]` (uint8) of `packed`, in the order of the inputs."""
    blocks = packed.reshape(*packed.shape[:-1], -1, BLOCK // 2)
    q = jnp.concatenate([blocks & 15, blocks >> 4], axis=-1)
    return q.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize(packed: jax.Array, scales: jax.Array) -> jax.Array:
    """The float32 weight `[..., out, in]` that `(packed, scales)` stores."""
    q = values(packed).astype(jnp.float32)
    q = q.reshape(*q.shape[:-1], -1, BLOCK)
    s = scales.astype(jnp.float32)
    w = s[..., 0:1] * q + s[..., 1:2]
    return w.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def from_gguf(raw: np.ndarray, kind, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF tensor's Q4_0 or Q4_1 blocks `raw` (its bytes) as `(packed, scales)` for the
    weight `shape` `[..., out, in]`, exactly: no value changes."""
    kind = gguf.GGMLQuantizationType(kind)
    if kind not in GGUF_TYPES:
        names = ", ".join(f"`{k.name}`" for k in GGUF_TYPES)
        raise ValueError(f"`kind` must be one of {names} to keep 4 bits exactly, got {kind.name}")
    if len(shape) < 2 or shape[-1] % BLOCK:
        raise ValueError(f"`shape` must be [..., out, in], `in` a multiple of 32, got {shape}")
    blocks = np.asarray(raw, np.uint8).reshape(-1, GGUF_TYPES[kind])
    if len(blocks) != math.prod(shape) // BLOCK:
        raise ValueError(f"`raw` holds {len(blocks)} blocks, `shape` {shape} needs others")
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0]
    if kind == gguf.GGMLQuantizationType.Q4_1:
        m, nibbles = blocks[:, 2:4].copy().view(np.float16)[:, 0], blocks[:, 4:]
    else:
        m, nibbles = -8 * d, blocks[:, 2:]
    scales = np.stack([d, m], axis=-1).reshape(*shape[:-1], shape[-1] // BLOCK, 2)
    return np.ascontiguousarray(nibbles).reshape(*shape[:-1], shape[-1] // 2), scales


def matmul(packed: jax.Array, scales: jax.Array, x: jax.Array) -> jax.Array:
    """`w @ x` for feature-major float `x` `[in, ...]`: `[..., out, ...]` in float32, with the
    weight dequantized inside the product (in float32 on CPU, bfloat16 elsewhere)."""
    dtype = jnp.float32 if jax.devices()[0].platform == "cpu" else jnp.bfloat16
    w = dequantize(packed, scales).astype(dtype)
    dims = (((w.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(w, x.astype(dtype), dims, preferred_element_type=jnp.float32)


def rows(packed: jax.Array, scales: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` `[...]` of a table stored in this format (an embedding), as float32
    `[..., features]`."""
    return dequantize(jnp.take(packed, ids, axis=0), jnp.take(scales, ids, axis=0))
