"""Llama-family decoder: Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2 and Qwen3.

Its classes are also the base of the other families (`jaxlm.models.olmo2`, ...), which
override the few methods where their math differs.

Attribute names follow the Hugging Face modules (`model.layers.0.self_attn.q_proj.weight`), so
a safetensors checkpoint loads by name. The variants differ only by config flags: biases on
q/k/v (Qwen2), RMSNorm on q and k per head (Qwen3), a sliding attention window (Mistral).

The model runs in two ways:
- `model(input_ids, positions, attention_mask)`: a full causal forward, no cache.
- `model.forward_paged(groups, cache)`: groups of rows of tokens against the paged KV cache,
  the declared pages the memory planner allocates (see `jaxlm.memory`); `generate` and the
  serving engine both run it. Each step's keys and values are written into the pages first and
  attention then reads the updated pages, the order in which XLA keeps donated pages in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import ops, quantization
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


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        h, d = config.hidden_size, config.head_dim
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        qkv_bias = config.attention_bias or config.model_type == "qwen2"
        o_bias = config.attention_bias and config.model_type != "qwen2"
        # Queries, keys and values as one product, `qkv_proj.weight` `[kv_heads, (groups + 2) *
        # head_dim, hidden]`: each KV head's block holds the rows of its query heads, its key and
        # its value (checkpoints' `q_proj`, `k_proj` and `v_proj`, see
        # `jaxlm.loading.names.GROUPED`; `docs/performance.md`, "Queries, keys and values as one
        # product"). On a mesh a block stays on one device: `model` splits the KV heads with
        # their query heads, or (where it does not divide them) replicates the projection.
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
        self._add_qk_norms(config, dtype)
        # The KV cache's pages, declared here and allocated by the planner.
        self.k_pages, self.v_pages = ops.paged_kv_specs(nkv, d, dtype)

    def _add_qk_norms(self, config: ModelConfig, dtype) -> None:
        # Qwen3 normalises each head of q and k.
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps, dtype=dtype)

    def _norm_qk(self, q, k):
        # q [heads, D, B, T], k [kv_heads, D, B, T].
        if self.config.qk_norm:
            return self.q_norm(q, axis=1), self.k_norm(k, axis=1)
        return q, k

    def _attend_options(self) -> dict:
        """`jaxlm.ops.attend`'s `scale` and `softcap`, where a family sets them."""
        return {}

    def _project(self, x, cos, sin, live):
        # x [hidden, B, T] -> q [heads, D, B, T], and keys and values in the cache layouts; a
        # chunk that is padding in every row (`live` false) is not rotated.
        _, b, t = x.shape
        c = self.config
        qkv = self.qkv_proj(x)  # [kv_heads, (groups + 2) * D, B, T]
        queries = c.num_kv_groups * c.head_dim
        q = qkv[:, :queries].reshape(c.num_attention_heads, c.head_dim, b, t)
        k, v = qkv[:, queries : queries + c.head_dim], qkv[:, queries + c.head_dim :]
        q, k = self._norm_qk(q, k)
        q, k = ops.before_layout(
            live, lambda q, k: (apply_rope(q, cos, sin), apply_rope(k, cos, sin)), q, k
        )
        # Keys and values are rounded to the cache dtype on both paths, so a cached forward
        # equals a full one in bfloat16 too.
        dtype = self.k_pages.dtype
        return q, *ops.to_cache_layout(k.astype(dtype), v.astype(dtype))

    def __call__(self, x, cos, sin, mask):
        # Every row of a whole sequence has tokens.
        out = ops.attend(*self._project(x, cos, sin, True), mask, **self._attend_options())
        return self.o_proj(out)

    def forward_paged(self, groups, cache):
        # Each group: (x, cos, sin, mask, slots, table, end). Their keys and values are written
        # in one update of the pages, then each group attends over its rows' first `end` slots.
        projected = [self._project(*g[:3], g[6] > 0) for g in groups]
        writes = [(k, v, g[4]) for (_, k, v), g in zip(projected, groups, strict=True)]
        cache = ops.write_paged(cache, writes)
        options = self._attend_options()
        outs = [
            self.o_proj(ops.attend_paged(q, cache, g[5], g[3], g[6], **options))
            for (q, _, _), g in zip(projected, groups, strict=True)
        ]
        return outs, cache


class DecoderLayer(nnx.Module):
    """A pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    Families that place their norms elsewhere override `_attention_input`,
    `_attention_output` and `_feed_forward`, which both forwards share.
    """

    attention_class = Attention
    mlp_class = MLP

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = self.attention_class(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = self.mlp_class(config, dtype=dtype, rngs=rngs)

    def _attention_input(self, x):
        return self.input_layernorm(x)

    def _attention_output(self, h):
        return h

    def _feed_forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, cos, sin, mask):
        h = self.self_attn(self._attention_input(x), cos, sin, mask)
        return self._feed_forward(x + self._attention_output(h))

    def forward_paged(self, xs, groups, cache):
        # `xs`: each group's activations; `groups`: each group's (cos, sin, mask, slots, table,
        # end).
        inputs = [(self._attention_input(x), *g) for x, g in zip(xs, groups, strict=True)]
        hs, attn = self.self_attn.forward_paged(inputs, cache["self_attn"])
        outs = [
            self._feed_forward(x + self._attention_output(h)) for x, h in zip(xs, hs, strict=True)
        ]
        return outs, {"self_attn": attn}


# A jitted layer: the layers share one signature, so a step traces and lowers one layer, not
# all of them; XLA inlines the calls, and the compiled step is the same (see
# `docs/performance.md`, "Tracing and dispatch").
@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer(method: str, graphdef, state, *args):
    return getattr(nnx.merge(graphdef, state), method)(*args)


class LlamaModel(nnx.Module):
    """The decoder stack. Families change the layer (`layer_class`), the norms' `(offset +
    weight)` scale (`norm_offset`), the embedding (`_embed`) and each layer type's RoPE
    settings (`_rope_config`)."""

    layer_class = DecoderLayer
    norm_offset = 0.0

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
            [
                self.layer_class(config, dtype=dtype, rngs=rngs)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, offset=self.norm_offset
        )

    def _embed(self, input_ids):
        return self.embed_tokens(input_ids)

    def _rope_config(self, layer_type: str) -> ModelConfig:
        """The config whose RoPE settings the layers of `layer_type` use."""
        return self.config

    def _mask(self, q_pos, k_pos, valid, window):
        # q_pos [B, T], k_pos [B, S], valid [B, S] -> [B, T, S].
        mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
        if window is not None:
            mask &= q_pos[:, :, None] - k_pos[:, None, :] < window
        return mask

    def _layer_inputs(self, q_pos, k_pos, valid, rope):
        """Each layer's `(cos, sin, mask)`, computed once per layer type (sliding or full
        attention) and once per RoPE config; `rope(config)` gives the `cos` and `sin`."""
        ropes, by_type = {}, {}
        types = self.config.attention_layer_types
        for layer_type in dict.fromkeys(types):
            config = self._rope_config(layer_type)
            if config not in ropes:
                ropes[config] = rope(config)
            window = self.config.sliding_window if layer_type == "sliding_attention" else None
            by_type[layer_type] = (*ropes[config], self._mask(q_pos, k_pos, valid, window))
        return [by_type[t] for t in types]

    def __call__(self, input_ids, positions, attention_mask):
        """The final hidden states `[hidden, batch, seq]`: activations flow feature-major (see
        `jaxlm.layers`)."""
        x = self._embed(input_ids)
        inputs = self._layer_inputs(
            positions, positions, attention_mask, lambda c: rope_cos_sin(c, positions)
        )
        for layer, layer_inputs in zip(self.layers, inputs, strict=True):
            x = layer(x, *layer_inputs)
        return self.norm(x)

    @staticmethod
    def _rope_once(config, positions):
        # The angles are computed once for all layers (`jaxlm.ops.computed_once`); a chunk that
        # is padding in every row, masked everywhere, is not rotated.
        def identity(positions):
            shape = (config.rotary_dim, *positions.shape)
            return jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)

        return ops.computed_once(
            jnp.max(positions) >= 0,
            functools.partial(rope_cos_sin, config),
            identity,
            jnp.maximum(positions, 0),
        )

    def forward_paged(self, groups, cache):
        """Groups of rows of tokens over a paged cache; each group is `(input_ids [R, C],
        positions [R, C] (-1: padding), table [R, pages_per_seq])`. Returns each group's final
        hidden states `[hidden, R, C]` and the updated pages."""
        num_pages, *_, size = cache["layers"][0]["self_attn"]["k_pages"].shape
        per_layer = [[] for _ in self.layers]
        for _, positions, table in groups:
            rows, per_seq = table.shape
            at = jnp.maximum(positions, 0)
            page = jnp.take_along_axis(table, at // size, axis=1)
            # Padding goes past the last page, where nothing is written.
            slots = jnp.where(positions >= 0, page * size + at % size, num_pages * size)
            length = per_seq * size
            k_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
            end = jnp.max(positions) + 1
            rope = functools.partial(self._rope_once, positions=positions)
            inputs = self._layer_inputs(positions, k_pos, jnp.ones(k_pos.shape, bool), rope)
            for i, layer_inputs in enumerate(inputs):
                per_layer[i].append((*layer_inputs, slots, table, end))
        xs, layers = [self._embed(ids) for ids, _, _ in groups], {}
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            xs, layers[i] = _layer(
                "forward_paged", graphdef, state, xs, per_layer[i], cache["layers"][i]
            )
        return [self.norm(x) for x in xs], {"layers": layers}


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal language model.

    Example:
        >>> model, tokenizer = jaxlm.load()
        >>> logits = model(jnp.array([tokenizer.encode("Hello")]))  # [1, seq, vocab]
    """

    model_class = LlamaModel

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.model = self.model_class(config, dtype=dtype, rngs=rngs)
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
    def abstract(
        cls, config: ModelConfig, *, dtype=jnp.float32, quantize: str | None = None
    ) -> LlamaForCausalLM:
        """The model with shapes but no weights (`nnx.eval_shape`): for `jaxlm.plan`, or to fill.
        With `quantize` (`"int8"`), its weights have the shapes `jaxlm.quantize` gives them.

        Example:
            >>> model = LlamaForCausalLM.abstract(config, dtype=jnp.bfloat16)
            >>> print(jaxlm.plan(model, max_batch=8, max_seq_len=8192))
        """

        def build():
            model = cls(config, dtype=dtype, rngs=nnx.Rngs(0))
            return model if quantize is None else quantization.quantize(model, quantize)

        with shapes_only():
            return nnx.eval_shape(build)

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

    def forward_paged(self, groups, cache):
        """Logits of groups of rows of tokens over a paged KV cache, and the updated cache.

        A group is a dict of `input_ids` `[R, C]`, their `positions` `[R, C]` (-1 for padding,
        at the end), `table` `[R, pages_per_seq]` and optionally `last` `[R]`. Row `r` holds a
        sequence's tokens; their keys and values go to the pages `table[r]` lists (position `p`
        to slot `p % page_size` of page `table[r, p // page_size]`), and each attends over its
        row's pages up to its own position. Rows may be at different positions and hold
        different numbers of tokens; groups of other widths (one token per row, a prompt's
        chunk) run in one call, their pages written in one update. A group's logits are
        `[R, C, vocab]`, or with `last`, those of column `last[r]` of each row, `[R, vocab]`.
        `cache` holds the pages each attention layer declares (`jaxlm.ops.paged_kv_specs`), as
        an engine's plan lays them out (`jaxlm.plan(model, max_num_seqs=...)`).
        """
        triples = [(g["input_ids"], g["positions"], g["table"]) for g in groups]
        xs, new = self.model.forward_paged(triples, cache["model"])
        logits = []
        for x, g in zip(xs, groups, strict=True):
            if g.get("last") is not None:
                x = jnp.take_along_axis(x, g["last"][None, :, None], axis=2)[..., 0]
            logits.append(self._logits(x))
        return logits, {"model": new}
