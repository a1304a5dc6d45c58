"""Llama-family decoder: Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2 and Qwen3.

Attribute names follow the Hugging Face modules (`model.layers.0.self_attn.q_proj.weight`), so
a safetensors checkpoint loads by name. The variants differ only by config flags: biases on
q/k/v (Qwen2), RMSNorm on q and k per head (Qwen3), a sliding attention window (Mistral).

The model runs in two ways:
- `model(input_ids, positions, attention_mask)`: a full causal forward, no cache.
- `model.forward_cached(input_ids, scratch)`: a chunk of tokens against the KV cache held in
  `scratch`, the declared state the memory planner allocates (see `jaxlm.memory`). Each chunk is
  written into the cache first and attention then reads the updated cache, the order in which
  XLA keeps a donated cache in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import ops
from jaxlm.config import ModelConfig
from jaxlm.layers import (
    MLP,
    Embedding,
    Linear,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
    shapes_only,
)
from jaxlm.memory import ScratchSpec


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        h, d = config.hidden_size, config.head_dim
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        qkv_bias = config.attention_bias or config.model_type == "qwen2"
        o_bias = config.attention_bias and config.model_type != "qwen2"
        # Queries, keys and values as one product, `qkv_proj.weight` `[kv_heads, (groups + 2) *
        # head_dim, hidden]`: each KV head's block holds the rows of its query heads, its key and
        # its value (checkpoints' `q_proj`, `k_proj` and `v_proj`, see `jaxlm.loading.GROUPED`;
        # `docs/performance.md`, "Queries, keys and values as one product"). On a mesh a block
        # stays on one device: `model` splits the KV heads with their query heads, or (where it
        # does not divide them) replicates the projection.
        self.qkv_proj = Linear(
            h,
            (config.num_kv_groups + 2) * d,
            bias=qkv_bias,
            dtype=dtype,
            rngs=rngs,
            stack=nkv,
            stack_axis="kv_heads",
        )
        self.o_proj = Linear(nh * d, h, bias=o_bias, dtype=dtype, rngs=rngs, axes=("heads", None))
        if config.qk_norm:
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
        # The KV cache, declared here and allocated by the planner, in `jaxlm.ops`'s layouts.
        self.k_cache, self.v_cache = ops.kv_cache_specs(nkv, d, dtype)

    def _project(self, x, cos, sin):
        # x [hidden, B, T] -> q [heads, D, B, T], and keys and values in the cache layouts.
        _, b, t = x.shape
        c = self.config
        qkv = self.qkv_proj(x)  # [kv_heads, (groups + 2) * D, B, T]
        queries = c.num_kv_groups * c.head_dim
        q = qkv[:, :queries].reshape(c.num_attention_heads, c.head_dim, b, t)
        k, v = qkv[:, queries : queries + c.head_dim], qkv[:, queries + c.head_dim :]
        if c.qk_norm:
            q, k = self.q_norm(q, axis=1), self.k_norm(k, axis=1)
        # Keys and values are rounded to the cache dtype on both paths, so a cached forward
        # equals a full one in bfloat16 too.
        dtype = self.k_cache.dtype
        k, v = ops.to_cache_layout(apply_rope(k, cos, sin).astype(dtype), v.astype(dtype))
        return apply_rope(q, cos, sin), k, v

    def __call__(self, x, cos, sin, mask):
        return self.o_proj(ops.attend(*self._project(x, cos, sin), mask))

    def forward_cached(self, x, cos, sin, mask, index, scratch):
        q, k, v = self._project(x, cos, sin)
        cache = ops.write_kv(scratch, k, v, index)
        out = ops.attend_cached(q, cache["k_cache"], cache["v_cache"], mask, index + x.shape[-1])
        return self.o_proj(out), cache


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, mask, index, scratch):
        h, attn = self.self_attn.forward_cached(
            self.input_layernorm(x), cos, sin, mask, index, scratch["self_attn"]
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), {"self_attn": attn}


# A jitted layer: the layers share one signature, so a step traces and lowers one layer, not
# all of them; XLA inlines the calls, and the compiled step is the same (see
# `docs/performance.md`, "Tracing and dispatch").
@functools.partial(jax.jit, static_argnums=0)
def _layer_cached(graphdef, state, x, cos, sin, mask, index, scratch):
    return nnx.merge(graphdef, state).forward_cached(x, cos, sin, mask, index, scratch)


class LlamaModel(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embedding(
            config.vocab_size,
            config.hidden_size,
            tied=config.tie_word_embeddings,
            dtype=dtype,
            rngs=rngs,
        )
        self.layers = nnx.List(
            [DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        # Where each row of the cache starts (prompts are left-aligned to a shared write slot)
        # and the next slot to write.
        self.cache_start = ScratchSpec(("batch",), jnp.int32, axes=("batch",), doc="first slot")
        self.cache_index = ScratchSpec((), jnp.int32, doc="next slot to write")

    def _mask(self, q_pos, k_pos, valid):
        # q_pos [B, T], k_pos [B, S], valid [B, S] -> [B, T, S].
        mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
        if self.config.sliding_window is not None:
            mask &= q_pos[:, :, None] - k_pos[:, None, :] < self.config.sliding_window
        return mask

    def __call__(self, input_ids, positions, attention_mask):
        """The final hidden states `[hidden, batch, seq]`: activations flow feature-major (see
        `jaxlm.layers`)."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.config, positions)
        mask = self._mask(positions, positions, attention_mask)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def _rope_once(self, positions):
        # The angles are computed once for all layers (`jaxlm.ops.computed_once`); a chunk that
        # is padding in every row, masked everywhere, is not rotated.
        def identity(positions):
            shape = (self.config.head_dim, *positions.shape)
            return jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)

        return ops.computed_once(
            jnp.max(positions) >= 0,
            functools.partial(rope_cos_sin, self.config),
            identity,
            jnp.maximum(positions, 0),
        )

    def forward_cached(self, input_ids, scratch):
        b, t = input_ids.shape
        index, start = scratch["cache_index"], scratch["cache_start"]
        seq = scratch["layers"][0]["self_attn"]["v_cache"].shape[1]
        q_slots = index + jnp.arange(t, dtype=jnp.int32)
        positions = q_slots[None, :] - start[:, None]  # [B, T]
        k_slots = jnp.arange(seq, dtype=jnp.int32)
        mask = self._mask(
            jnp.broadcast_to(q_slots, (b, t)),
            jnp.broadcast_to(k_slots, (b, seq)),
            k_slots[None, :] >= start[:, None],
        )
        cos, sin = self._rope_once(positions)
        x = self.embed_tokens(input_ids)
        layers = {}
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            x, layers[i] = _layer_cached(
                graphdef, state, x, cos, sin, mask, index, scratch["layers"][i]
            )
        new = {"cache_start": start, "cache_index": index + t, "layers": layers}
        return self.norm(x), new


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal language model.

    Example:
        >>> model, tokenizer = jaxlm.load()
        >>> logits = model(jnp.array([tokenizer.encode("Hello")]))  # [1, seq, vocab]
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.model = LlamaModel(config, dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.hidden_size,
                config.vocab_size,
                bias=False,
                dtype=dtype,
                rngs=rngs,
                axes=(None, "vocab"),
            )

    @classmethod
    def abstract(cls, config: ModelConfig, *, dtype=jnp.float32) -> LlamaForCausalLM:
        """The model with shapes but no weights (`nnx.eval_shape`): for `jaxlm.plan`, or to fill.

        Example:
            >>> model = LlamaForCausalLM.abstract(config, dtype=jnp.bfloat16)
            >>> print(jaxlm.plan(model, max_batch=8, max_seq_len=8192))
        """
        with shapes_only():
            return nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))

    def _logits(self, x):
        # x [hidden, ...] -> [..., vocab].
        if self.config.tie_word_embeddings:
            return ops.rows_last(self.model.embed_tokens.attend(x))
        return ops.rows_last(self.lm_head(x))

    def __call__(self, input_ids, positions=None, attention_mask=None) -> jax.Array:
        """Logits `[batch, seq, vocab]` (float32) of a causal forward over `input_ids`.

        `attention_mask` `[batch, seq]` marks real tokens (1) and padding (0), on either side.
        Without `positions`, each row counts positions from its first real token.
        """
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim != 2:
            raise ValueError(f"`input_ids` must be [batch, seq], got shape {input_ids.shape}")
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        attention_mask = jnp.asarray(attention_mask).astype(bool)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
        positions = jnp.asarray(positions, jnp.int32)
        return self._logits(self.model(input_ids, positions, attention_mask))

    def forward_cached(self, input_ids, scratch, last_only: bool = False):
        """Run `input_ids` `[batch, t]` against the cache in `scratch`; returns `(logits, scratch)`.

        The tokens are written at the cache's next slot for every row; with `last_only`, only
        the logits of the last position are computed (`[batch, vocab]`).
        """
        x, new = self.model.forward_cached(input_ids, scratch["model"])
        return self._logits(x[..., -1] if last_only else x), {**scratch, "model": new}
