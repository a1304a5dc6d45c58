"""Building blocks shared by the decoders: linear layers, RMSNorm, rotary embeddings, SwiGLU MLP.

Parameters are named and laid out as in Hugging Face checkpoints: 2-D weights are `[out, in]`,
and a matmul contracts the last dimension of both operands (PyTorch's `F.linear`). Measured on
this project's Xeon with AMX (`benchmarks/matmul_step.py`, every projection and the LM head of
SmolLM2, ms per decode step), against `[in, out]` weights contracted on their first dimension:

| rows | float32 `[out, in]` | float32 `[in, out]` | bfloat16 `[out, in]` | bfloat16 `[in, out]` |
|---|---|---|---|---|
| 1 | 25.5 | 25.4 | (4 rows: see `matmul`) | |
| 4 | | | 22.5 | 30.0 |
| 8 | 38.0 | 43.9 | 23.0 | 30.4 |
| 128 | 104.0 | 108.4 | 58.2 | 62.6 |

Other CPUs differ: on an AMD EPYC, `[in, out]` ran 1.47x faster at 8 rows and 15-28% slower at
1 row; on an Ice Lake Xeon, the two were within 7% of each other at 1 and 8 rows.

Activations flow in float32; a matmul casts its input to the weight dtype and accumulates in
float32 (`preferred_element_type`), which runs natively in bfloat16 on CPUs with bf16
instructions, from 4 rows on (see `matmul`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.memory import platform

_SHAPES_ONLY = contextvars.ContextVar("jaxlm_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Within it, layers create zeros instead of drawing random weights.

    For abstract models (`nnx.eval_shape`), whose values are never computed: tracing 211 random
    initialisers took most of the 0.65 s that building SmolLM2 abstractly took.
    """
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    if _SHAPES_ONLY.get():
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


# XLA:CPU runs a bfloat16 matmul natively (YNNPACK) from this many rows on.
_NATIVE_BF16_ROWS = 4


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` for `w` `[out, in]`, accumulated in float32.

    On CPU, bfloat16 weights meet at least 4 rows: with fewer, XLA computes in float32 and
    converts the whole weight, a conversion that it hoists out of the decode loop, so a bf16
    model held a float32 copy of its weights while it decoded (SmolLM2: 513 MiB of temporaries
    on 257 MiB of weights). The padded rows cost less than the copy: bf16 decode at batch 1 ran
    the matmuls of a step in 22.5 ms, float32 in 25.5 ms (`benchmarks/matmul_step.py`).
    float16 weights are converted to float32 at any row count, so padding them gains nothing.

    On CPU, a one-row product with a small matrix runs as a batched dot of one part of the
    matrix per thread (see `_gemv_parts`).
    """
    rows = math.prod(x.shape[:-1])
    if w.dtype == jnp.bfloat16 and rows < _NATIVE_BF16_ROWS and platform() == "cpu":
        flat = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, _NATIVE_BF16_ROWS - rows), (0, 0)))
        return matmul(flat, w)[:rows].reshape(*x.shape[:-1], w.shape[0])
    parts = _gemv_parts(w) if rows == 1 else 1
    if parts > 1:
        # `w` `[out, in]` viewed as `[parts, out / parts, in]` (a bitcast): one matrix-vector
        # product per part, in a batched dot whose batch XLA:CPU spreads over its threads.
        n, k = w.shape
        xs = jnp.broadcast_to(x.reshape(1, 1, k).astype(w.dtype), (parts, 1, k))
        ws = w.reshape(parts, n // parts, k)
        dims = (((2,), (2,)), ((0,), (0,)))
        y = jax.lax.dot_general(xs, ws, dims, preferred_element_type=jnp.float32)
        return y.reshape(*x.shape[:-1], n)
    return jax.lax.dot_general(
        x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


# XLA:CPU splits a matrix-vector product into one work group per started 2 MiB of its matrix,
# at most 8, which its threads share: a matrix of at most 2 MiB runs on one thread.
_GEMV_ONE_THREAD_BYTES = 2 << 20


@functools.cache
def _cpu_threads() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _gemv_parts(w: jax.Array) -> int:
    """In how many parts a one-row product with `w` runs: one per CPU thread for a matrix that
    XLA would leave on one thread, else 1 (also off CPU, and on several devices, where the
    weights are sharded).

    SmolLM2's q, k, v and o (1.3 and 0.4 MiB in float32) ran on one of the 2 cores at 13 GB/s.
    Split, the float32 matmuls of a decode step took 20.9 ms instead of 26.3
    (`benchmarks/matmul_step.py`, `out,in` vs `out,in one dot`). With more rows, XLA computes
    a matrix product, which splitting slowed down (8 rows: 43.0 vs 40.8 ms).
    """
    threads = min(_cpu_threads(), 8)
    if (
        threads < 2
        or w.size * w.dtype.itemsize > _GEMV_ONE_THREAD_BYTES
        or w.shape[0] % threads
        or platform() != "cpu"
        or jax.device_count() > 1
    ):
        return 1
    return threads


class Linear(nnx.Module):
    """`y = x @ weight.T + bias`, with `weight` stored as `[out, in]`.

    `axes` names the logical sharding axes of `in` and `out` (see `jaxlm.sharding`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype,
        rngs: nnx.Rngs,
        axes: tuple[str | None, str | None] = (None, None),
    ):
        weight = _normal(rngs, (out_features, in_features), dtype)
        self.weight = nnx.Param(weight, axes=axes[::-1])
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), axes=axes[1:]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul(x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y


class Embedding(nnx.Module):
    """Token embeddings `[vocab, features]`, also the LM head when the embeddings are tied.

    XLA:CPU gathers 16-bit float rows from a float32 copy of the whole table, which it hoists
    out of the decode loop (1.9 GiB for Llama-3.1-8B in bf16), and a bitcast of the whole table
    to integers is hoisted as a copy too. So on CPU an untied 16-bit table is stored as its
    `uint16` bits, whose rows gather in place and exactly; a `tied` one keeps its floats, which
    the LM head's matmul needs.
    """

    def __init__(self, num_embeddings: int, features: int, *, tied: bool, dtype, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(dtype)
        weight = _normal(rngs, (num_embeddings, features), dtype)
        if self.dtype.itemsize == 2 and not tied and platform() == "cpu":
            weight = jax.lax.bitcast_convert_type(weight, jnp.uint16)
        self.weight = nnx.Param(weight, axes=("vocab", None))

    def __call__(self, ids: jax.Array) -> jax.Array:
        weight = self.weight[...]
        if weight.dtype == jnp.uint16 or (self.dtype.itemsize == 2 and platform() == "cpu"):
            # A tied 16-bit table gathers from its bits too: XLA then copies the bits, half
            # the bytes of a float32 copy.
            bits = jax.lax.bitcast_convert_type(weight, jnp.uint16)
            rows = jax.lax.bitcast_convert_type(jnp.take(bits, ids, axis=0), self.dtype)
            return rows.astype(jnp.float32)
        return jnp.take(weight, ids, axis=0).astype(jnp.float32)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding matrix (the tied LM head)."""
        return matmul(x, self.weight[...])


class RMSNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * self.weight[...].astype(jnp.float32)


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        column, row = (None, "mlp"), ("mlp", None)
        self.gate_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs, axes=column)
        self.up_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs, axes=column)
        self.down_proj = Linear(i, h, bias=bias, dtype=dtype, rngs=rngs, axes=row)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[head_dim // 2]` of the rotary embedding, with static scaling applied.

    Dynamic NTK scaling depends on the sequence length and is applied in `rope_cos_sin`.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`cos` and `sin` of the rotary angles for `positions` `[B, T]`, each `[B, T, head_dim]`."""
    inv_freq = jnp.asarray(rope_inv_freq(config))
    scaling = config.rope_scaling
    if scaling.rope_type == "dynamic":
        # Dynamic NTK: the base grows with the longest position of the call, as transformers does.
        d = config.head_dim
        max_len = config.max_position_embeddings
        seq_len = jnp.maximum(jnp.max(positions) + 1, max_len).astype(jnp.float32)
        base = config.rope_theta * (scaling.factor * seq_len / max_len - (scaling.factor - 1)) ** (
            d / (d - 2)
        )
        inv_freq = 1.0 / base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` `[B, T, heads, head_dim]` (the rotate-half convention of Hugging Face)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
