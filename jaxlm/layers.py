"""Building blocks shared by the decoders: linear layers, RMSNorm, rotary embeddings, SwiGLU MLP.

Parameters are named and laid out as in Hugging Face checkpoints: 2-D weights are `[out, in]`.
Activations flow feature-major, `[features, ...]` (`[hidden, batch, seq]` between layers), so
that a matmul is `w @ x`, the weight its left operand (see `matmul`). Measured on this
project's Xeon with AMX (`benchmarks/matmul_step.py`, every projection and the LM head of
SmolLM2, ms per decode step), against row-major activations, `x @ w.T` (PyTorch's `F.linear`,
jaxlm's layout before) and `x @ w` with `[in, out]` weights:

| rows | f32 `w @ x` | f32 `x @ w.T` | f32 `x @ w` | bf16 `w @ x` | bf16 `x @ w.T` | bf16 `x @ w` |
|---|---|---|---|---|---|---|
| 1 | 21.3 | 27.1 | 26.4 | 15.1 | 38.5 | 38.1 |
| 2 | 35.5 | 35.3 | 33.0 | 15.8 | 23.2 | 32.6 |
| 4 | | | | 15.4 | 21.2 | 30.7 |
| 8 | 39.6 | 42.9 | 51.9 | 17.8 | 22.4 | 31.9 |

One row of `w @ x` is `matmul`'s split over the threads (f32) or its padding to 2 (bf16); the
others are one dot each (bf16 at one row then converts the weights to f32). At 128 rows, a
prompt's chunk, the float32 gate and up projections ran slower feature-major (59.6 vs 51.0 ms
of a 128-token prefill) and the other projections faster (50.3 vs 56.0): the float32 prefill
of 128 tokens lost 2-6% (7-14% in `benchmarks/bench.py`); bf16 prefill held and decode gained.
Gate and up as one product (see `MLP`) won the float32 prefill back (52.1 ms for both).

Other CPUs differ: with row-major activations, an AMD EPYC ran `[in, out]` weights 1.47x faster
than `[out, in]` at 8 rows; the operand order was measured on this Xeon only.

Activations are float32; a matmul casts its input to the weight dtype and accumulates in float32
(`preferred_element_type`), which runs natively in bfloat16 on CPUs with bf16 instructions, from
2 columns of `x` on (see `matmul`).
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


# XLA:CPU runs a bfloat16 matmul natively (YNNPACK) from this many columns of `x` on.
_NATIVE_BF16_COLUMNS = 2


def matmul(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w @ x` for `w` `[..., out, in]` and feature-major `x` `[in, ...]`: `[..., out, ...]`,
    accumulated in float32. Leading dimensions of `w` stack matrices that multiply the same `x`
    as one product (see `MLP`).

    The weight is the left operand, which YNNPACK (XLA:CPU's matmuls) streams as stored; a right
    operand it repacks at every call. SmolLM2, the matmuls of a decode step against `x @ w.T`
    (`benchmarks/matmul_step.py`): bfloat16 at 4 rows 21.2 -> 15.4 ms, float32 at 8 rows
    42.9 -> 39.6 ms.

    On CPU, bfloat16 weights meet at least 2 columns: with one, XLA computes in float32 and
    converts the whole weight, a conversion that it hoists out of the decode loop, so a bf16
    model held a float32 copy of its weights while it decoded (SmolLM2: 513 MiB of temporaries
    on 257 MiB of weights). The padded column costs less than the copy: 15.1 ms per step of
    bf16 matmuls at batch 1 against 21.3 in float32. float16 weights are converted to float32
    at any size, so padding them gains nothing.

    On CPU, a one-column product runs as a batched dot of parts of the matrix (see
    `_gemv_parts`).
    """
    cols = math.prod(x.shape[1:])
    out = (*w.shape[:-1], *x.shape[1:])
    if w.dtype == jnp.bfloat16 and cols < _NATIVE_BF16_COLUMNS and platform() == "cpu":
        flat = jnp.pad(x.reshape(x.shape[0], cols), ((0, 0), (0, _NATIVE_BF16_COLUMNS - cols)))
        return matmul(w, flat)[..., :cols].reshape(out)
    parts = _gemv_parts(w) if cols == 1 else 1
    if parts > 1:
        # `w` viewed as `[parts, rows / parts, in]` (a bitcast): one matrix-vector product per
        # part, in a batched dot whose batch XLA:CPU spreads over its threads.
        k = w.shape[-1]
        xs = jnp.broadcast_to(x.reshape(1, k, 1).astype(w.dtype), (parts, k, 1))
        ws = w.reshape(parts, -1, k)
        dims = (((2,), (1,)), ((0,), (0,)))
        y = jax.lax.dot_general(ws, xs, dims, preferred_element_type=jnp.float32)
        return y.reshape(out)
    dims = (((w.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(w, x.astype(w.dtype), dims, preferred_element_type=jnp.float32)


# A one-column product runs as a batched dot of this many parts of its matrix (see `_gemv_parts`).
_GEMV_PARTS = 8


@functools.cache
def _cpu_threads() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _gemv_parts(w: jax.Array) -> int:
    """In how many parts a one-column product with `w` runs: `_GEMV_PARTS` on a CPU with
    several threads where that many divide its rows, else 1 (also off CPU, and on several
    devices, where the weights are sharded).

    XLA:CPU splits a matrix-vector product into one work group per started 2 MiB of its matrix
    (at most 8), so SmolLM2's q, k, v and o (1.3 and 0.4 MiB in float32) ran on one of the 2
    cores at 13 GB/s; one part per thread took the float32 matmuls of a decode step from 27.2
    to 21.3 ms (`benchmarks/matmul_step.py`, `w @ x` vs `w @ x one dot`). Eight parts do
    better than one per thread: the threads take the parts as they come, and a thread woken
    from sleep, 35-40 us late on this machine's virtual CPUs, finds fewer parts left instead
    of its half still to do. SmolLM2's float32 decode, alternated in one process, three runs:
    40.5 / 40.3 / 39.9 tok/s against 38.6 / 39.7 / 38.8 with one part per thread below 2 MiB
    and XLA's split above (16 parts below 2 MiB: 35.6). With more columns, XLA computes a
    matrix product, which splitting slowed down (8 rows, row-major: 43.0 vs 40.8 ms).
    """
    rows = w.size // w.shape[-1]
    if _cpu_threads() < 2 or rows % _GEMV_PARTS or platform() != "cpu" or jax.device_count() > 1:
        return 1
    return _GEMV_PARTS


class Linear(nnx.Module):
    """`y = weight @ x + bias` on feature-major `x` `[in, ...]`, with `weight` stored as
    `[out, in]`, or as `[stack, out, in]` for `stack` projections of the same input computed
    as one product.

    `axes` names the logical sharding axes of `in` and `out`, `stack_axis` that of `stack`
    (see `jaxlm.sharding`).
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
        stack: int | None = None,
        stack_axis: str | None = None,
    ):
        lead, lead_axes = ((), ()) if stack is None else ((stack,), (stack_axis,))
        weight = _normal(rngs, (*lead, out_features, in_features), dtype)
        self.weight = nnx.Param(weight, axes=lead_axes + axes[::-1])
        self.bias = (
            nnx.Param(jnp.zeros((*lead, out_features), dtype), axes=lead_axes + axes[1:])
            if bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x` `[in, ...]` (feature-major) -> `[out, ...]` (`[stack, out, ...]`)."""
        y = matmul(self.weight[...], x)
        if self.bias is not None:
            b = self.bias[...].astype(jnp.float32)
            y = y + b.reshape(*b.shape, *(1,) * (y.ndim - b.ndim))
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
        """The rows of `ids` `[...]`, feature-major: `[features, ...]` (float32)."""
        return jnp.moveaxis(self._rows(ids), -1, 0)

    def _rows(self, ids: jax.Array) -> jax.Array:
        weight = self.weight[...]
        if weight.dtype == jnp.uint16 or (self.dtype.itemsize == 2 and platform() == "cpu"):
            # A tied 16-bit table gathers from its bits too: XLA then copies the bits, half
            # the bytes of a float32 copy.
            bits = jax.lax.bitcast_convert_type(weight, jnp.uint16)
            rows = jax.lax.bitcast_convert_type(jnp.take(bits, ids, axis=0), self.dtype)
            return rows.astype(jnp.float32)
        return jnp.take(weight, ids, axis=0).astype(jnp.float32)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits `[vocab, ...]` of `x` `[features, ...]` against the embedding matrix (the tied
        LM head)."""
        return matmul(self.weight[...], x)


class RMSNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, axis: int = 0) -> jax.Array:
        """`x` normalised over its features, dimension `axis`."""
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=axis, keepdims=True) + self.eps)
        return x * _along(self.weight[...].astype(jnp.float32), axis, x.ndim)


def _along(v: jax.Array, axis: int, ndim: int) -> jax.Array:
    """The vector `v` shaped to broadcast along dimension `axis` of an `ndim`-dimensional array."""
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return v.reshape(shape)


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`.

    The gate and up weights are stacked, `gate_up_proj.weight` `[2, intermediate, hidden]`
    (checkpoints' `gate_proj` and `up_proj`, see `jaxlm.loading.STACKED`), and multiply as one
    product: SmolLM2's float32 prefill of 128 tokens took 131-132 ms instead of 139-140 (one
    [3072, 576] product per layer instead of two [1536, 576]); float32 decode and bf16 prefill
    held, and bf16 decode at batch 1 ran 1-4% slower timed directly, within the noise of
    `benchmarks/bench.py`. A chunk of 64 to 256 tokens runs through the MLP in two halves (see
    `_halves_columns`).
    """

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        column, row = (None, "mlp"), ("mlp", None)
        self.gate_up_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs, axes=column, stack=2)
        self.down_proj = Linear(i, h, bias=bias, dtype=dtype, rngs=rngs, axes=row)

    def __call__(self, x: jax.Array) -> jax.Array:
        cols = math.prod(x.shape[1:])
        if not _halves_columns(cols):
            gate, up = self.gate_up_proj(x)
            return self.down_proj(jax.nn.silu(gate) * up)
        flat = x.reshape(x.shape[0], cols)
        halves = []
        for half in (flat[:, : cols // 2], flat[:, cols // 2 :]):
            gate, up = self.gate_up_proj(half)
            halves.append(self.down_proj(jax.nn.silu(gate) * up))
        return jnp.concatenate(halves, axis=1).reshape(-1, *x.shape[1:])


# `MLP` runs its products in two halves of the columns for this many columns (see
# `_halves_columns`).
_HALVED_COLUMNS = range(64, 257)


def _halves_columns(cols: int) -> bool:
    """Whether `MLP` runs `cols` columns (a prompt's chunk of tokens) as two halves, each
    through all three products: on a CPU with several threads, for an even number of columns in
    `_HALVED_COLUMNS` (not on several devices, where the columns are sharded).

    Two halves ran faster than one product at a few columns. SmolLM2's prefill, alternated in
    one process against the whole chunk (two models of each, medians of the time to the first
    token): float32, 128 tokens, 129.8 / 129.6 ms instead of 134.1 / 132.4; bfloat16, 128
    tokens, 66.6 / 65.7 ms instead of 68.8 / 68.2, and 2 x 128 tokens, 113.7 / 110.8 instead of
    116.9 / 117.8. With more columns the halves gained nothing or lost: float32 4 x 128 tokens,
    490.8 / 496.2 ms against 493.6 / 493.5, and 8 x 128, 860 / 846 against 876 / 860; bfloat16
    4 x 128, 196.2 / 192.0 against 185.6 / 183.0, and 8 x 128, 325 / 329 against 302 / 306.
    Four or eight parts of a 128-token chunk ran slower than two (147 and 159 ms against
    128.5), and so did halving the gate and up product alone, which joins the halves of its
    large output before the activation.
    """
    threads_ok = _cpu_threads() > 1 and platform() == "cpu" and jax.device_count() == 1
    return threads_ok and cols in _HALVED_COLUMNS and cols % 2 == 0


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
    """`cos` and `sin` of the rotary angles for `positions` `[B, T]`, each `[head_dim, B, T]`."""
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
    angles = inv_freq[:, None, None] * positions.astype(jnp.float32)  # [head_dim // 2, B, T]
    angles = jnp.concatenate([angles, angles], axis=0)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` `[heads, head_dim, B, T]` (the rotate-half convention of Hugging Face)."""
    half = x.shape[1] // 2
    rotated = jnp.concatenate([-x[:, half:], x[:, :half]], axis=1)
    return x * cos + rotated * sin
