"""Building blocks shared by the decoders: linear layers, RMSNorm, rotary embeddings, gated MLPs.

Parameters are named and laid out as in Hugging Face checkpoints: 2-D weights are `[out, in]`.
Activations are float32 and flow feature-major, `[features, ...]` (`[hidden, batch, seq]`
between layers), so that a product is `w @ x` with the weight as its left operand (see
`jaxlm.ops.matmul` and `docs/performance.md`, "Operand order"). The products themselves, and
how they lower on each backend, are `jaxlm.ops`'s.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm import ops
from jaxlm.config import ModelConfig

_SHAPES_ONLY = contextvars.ContextVar("jaxlm_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Within it, layers create zeros instead of drawing random weights.

    For abstract models (`nnx.eval_shape`), whose values are never computed: tracing the random
    initialisers took most of the time of building a model abstractly (see
    `docs/performance.md`, "Tracing and dispatch").
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


class Linear(nnx.Module):
    """`y = weight @ x + bias` on feature-major `x` `[in, ...]`, with `weight` stored as
    `[out, in]`, or as `[stack, out, in]` for `stack` projections of the same input computed
    as one product.

    `axes` names the logical sharding axes of `in` and `out`, `stack_axis` that of `stack`
    (see `jaxlm.sharding`). `jaxlm.quantize` stores `weight` as int8 with one float32 `scale`
    per output row.
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
        # Set by `jaxlm.quantize`.
        self.scale = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x` `[in, ...]` (feature-major) -> `[out, ...]` (`[stack, out, ...]`)."""
        if self.scale is None:
            y = ops.matmul(self.weight[...], x)
        else:
            y = ops.quantized_matmul(self.weight[...], self.scale[...], x)
        if self.bias is not None:
            b = self.bias[...].astype(jnp.float32)
            y = y + b.reshape(*b.shape, *(1,) * (y.ndim - b.ndim))
        return y


class Embedding(nnx.Module):
    """Token embeddings `[vocab, features]`, also the LM head when the embeddings are tied.

    The table is stored as `jaxlm.ops.embedding_storage` chooses (on CPU, an untied 16-bit
    table as its bits), or by `jaxlm.quantize` as int8 with one float32 `scale` per row.
    """

    def __init__(self, num_embeddings: int, features: int, *, tied: bool, dtype, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(dtype)
        weight = _normal(rngs, (num_embeddings, features), dtype)
        self.weight = nnx.Param(ops.embedding_storage(weight, tied), axes=("vocab", None))
        # Set by `jaxlm.quantize`.
        self.scale = nnx.data(None)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """The rows of `ids` `[...]`, feature-major: `[features, ...]` (float32)."""
        if self.scale is None:
            rows = ops.embedding_rows(self.weight[...], ids, self.dtype)
        else:
            rows = ops.quantized_rows(self.weight[...], self.scale[...], ids)
        return jnp.moveaxis(rows, -1, 0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits `[vocab, ...]` of `x` `[features, ...]` against the embedding matrix (the tied
        LM head)."""
        if self.scale is None:
            return ops.matmul(self.weight[...], x)
        return ops.quantized_matmul(self.weight[...], self.scale[...], x)


class RMSNorm(nnx.Module):
    """RMSNorm scaled by `offset + weight`: Gemma stores the weight less one (`offset=1`)."""

    def __init__(self, features: int, *, eps: float, dtype, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((features,), 1.0 - offset, dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array, axis: int = 0) -> jax.Array:
        """`x` normalised over its features, dimension `axis`."""
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=axis, keepdims=True) + self.eps)
        weight = self.weight[...].astype(jnp.float32)
        if self.offset:
            weight = self.offset + weight
        return x * _along(weight, axis, x.ndim)


def _along(v: jax.Array, axis: int, ndim: int) -> jax.Array:
    """The vector `v` shaped to broadcast along dimension `axis` of an `ndim`-dimensional array."""
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return v.reshape(shape)


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`.

    The gate and up weights are stacked, `gate_up_proj.weight` `[2, intermediate, hidden]`
    (checkpoints' `gate_proj` and `up_proj`, see `jaxlm.loading.names.STACKED`), and multiply as one
    product (see `docs/performance.md`, "Gate and up as one product"). A chunk of tokens runs
    in the parts of its columns that `jaxlm.ops.mlp_column_parts` gives.
    """

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        column, row = (None, "mlp"), ("mlp", None)
        self.gate_up_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs, axes=column, stack=2)
        self.down_proj = Linear(i, h, bias=bias, dtype=dtype, rngs=rngs, axes=row)

    @staticmethod
    def activation(gate: jax.Array) -> jax.Array:
        return jax.nn.silu(gate)

    def _gated(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(self.activation(gate) * up)

    def __call__(self, x: jax.Array) -> jax.Array:
        cols = math.prod(x.shape[1:])
        parts = ops.mlp_column_parts(cols)
        if parts == 1:
            return self._gated(x)
        flat = x.reshape(x.shape[0], cols)
        outs = [self._gated(part) for part in jnp.split(flat, parts, axis=1)]
        return jnp.concatenate(outs, axis=1).reshape(-1, *x.shape[1:])


class GeGLU(MLP):
    """Gemma's MLP: `down(gelu(gate(x)) * up(x))`, with the tanh approximation of GELU
    (`gelu_pytorch_tanh`)."""

    @staticmethod
    def activation(gate: jax.Array) -> jax.Array:
        return jax.nn.gelu(gate, approximate=True)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[rotary_dim // 2]` of the rotary embedding, with static scaling
    applied (LongRoPE's short factors).

    Dynamic NTK scaling and LongRoPE's long factors depend on the sequence length and are
    applied in `rope_cos_sin`.
    """
    d = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    scaling = config.rope_scaling
    if scaling.rope_type == "longrope":
        inv_freq = _longrope_inv_freq(config, scaling.short_factor)
    elif scaling.rope_type == "linear":
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


def _longrope_inv_freq(config: ModelConfig, factors: tuple[float, ...]) -> np.ndarray:
    # In transformers' order of float32 operations: each base power times its factor, inverted.
    d = config.rotary_dim
    powers = config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
    return (1.0 / (np.asarray(factors, np.float32) * powers)).astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`cos` and `sin` of the rotary angles for `positions` `[B, T]`, each `[rotary_dim, B, T]`,
    scaled by LongRoPE's `attention_factor`."""
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
    angles = inv_freq[:, None, None] * positions.astype(jnp.float32)  # [rotary_dim // 2, B, T]
    if scaling.rope_type == "longrope":
        # A row takes the long factors where its last position reaches the original context:
        # transformers chooses so for all the positions of a call (see `jaxlm.models.phi3`).
        long = jnp.max(positions, axis=1) >= scaling.original_max_position_embeddings  # [B]
        long_freq = jnp.asarray(_longrope_inv_freq(config, scaling.long_factor))
        long_angles = long_freq[:, None, None] * positions.astype(jnp.float32)
        angles = jnp.where(long[:, None], long_angles, angles)
    angles = jnp.concatenate([angles, angles], axis=0)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` `[heads, head_dim, B, T]` (the rotate-half convention of Hugging Face): its
    first `cos.shape[0]` features, the others passing unchanged (partial rotary embeddings)."""
    rotary = cos.shape[0]
    if rotary < x.shape[1]:
        return jnp.concatenate([apply_rope(x[:, :rotary], cos, sin), x[:, rotary:]], axis=1)
    half = x.shape[1] // 2
    rotated = jnp.concatenate([-x[:, half:], x[:, :half]], axis=1)
    return x * cos + rotated * sin
