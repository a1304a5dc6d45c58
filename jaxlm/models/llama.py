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
from jaxlm.memory import ScratchSpec, read_cache, write_cache

_MASKED = -1e30
# The smallest part of the KV cache that attention reads: see `Attention._attend_filled`.
FILLED_BUCKET = 256


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
        # `jaxlm.loading.GROUPED`). A decode step then starts the threads of one product instead
        # of three: SmolLM2's float32 decode, alternated in one process, 44.5 / 42.8 / 42.9
        # tok/s against 40.3 / 39.9 / 41.2 with three (all with `matmul`'s 8 parts), bfloat16
        # 59.2 against 57.1. At batch 8 the three products, which XLA runs side by side, did
        # better: bfloat16 312 / 305 tok/s against 282 / 280, float32 154 against 151. On a
        # mesh, a block stays on one device: the `model` axis splits the KV heads with their
        # query heads, or (where it does not divide the KV heads) replicates the projection.
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
        # The KV cache, declared here and allocated by the planner: keys as
        # [batch * kv_heads, head_dim, seq] and values as [batch * kv_heads, seq, head_dim],
        # the layouts in which both attention products are plain batched matmuls (reading
        # keys stored as [.., seq, head_dim] ran 1.4x slower). Folding the batch into the
        # heads keeps a batch of one from being a unit dimension that XLA drops with a bitcast
        # between the cache update and the matmul: with [1, kv_heads, ...], XLA:CPU duplicated
        # the update fusion and copied each cache twice per step (a cache of 2048 slots cost
        # 94 MiB of temporaries). On a mesh, the folded dimension splits over `data` x `model`:
        # device (i, j) holds the (i * model + j)-th block of (row, KV head) pairs, which are
        # the rows of data shard i and the heads of model shard j when `model` is 1 or each
        # data shard holds one row. Attention runs where the cache lies either way; only the
        # new tokens' keys, values and queries move between devices.
        cache_axes = (("batch", "kv_heads"), None, None)
        self.k_cache = ScratchSpec(
            (("batch", nkv), d, "seq"), dtype, axes=cache_axes, doc="attention keys"
        )
        self.v_cache = ScratchSpec(
            (("batch", nkv), "seq", d), dtype, axes=cache_axes, doc="attention values"
        )

    def _project(self, x, cos, sin):
        # x [hidden, B, T] -> q [heads, D, B, T], keys [B * kv_heads, D, T] and values
        # [B * kv_heads, T, D] (the cache layouts).
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
        k, v = apply_rope(k, cos, sin).astype(dtype), v.astype(dtype)
        k = k.transpose(2, 0, 1, 3).reshape(b * c.num_key_value_heads, c.head_dim, t)
        v = v.transpose(2, 0, 3, 1).reshape(b * c.num_key_value_heads, t, c.head_dim)
        return apply_rope(q, cos, sin), k, v

    def _attend(self, q, k, v, mask):
        # q [heads, D, B, T]; k [B * kv_heads, D, S]; v [B * kv_heads, S, D]; mask [B, T, S].
        # Returns the heads' outputs [heads * D, B, T], before `o_proj`.
        _, d, b, t = q.shape
        c = self.config
        nkv, g = c.num_key_value_heads, c.num_kv_groups
        q = q.reshape(nkv, g, d, b, t).transpose(3, 0, 1, 4, 2).reshape(b * nkv, g * t, d)
        # A chunk of several tokens multiplies in the cache's dtype, accumulating in float32:
        # bf16 runs natively on CPUs with bf16 instructions (SmolLM2's prefill of 8 x 128
        # tokens: 2030 -> 2300 tok/s). A decode step converts the cache to float32 instead;
        # its bf16 products ran slower (217 -> 153 tok/s at batch 8).
        dtype = k.dtype if t > 1 else jnp.float32
        f32 = jnp.float32
        scores = jnp.einsum("nqd,nds->nqs", q.astype(dtype), k, preferred_element_type=f32)
        scores = scores * (d**-0.5)
        mask = jnp.broadcast_to(mask[:, None, None], (b, nkv, g, t, mask.shape[-1]))
        scores = jnp.where(mask.reshape(b * nkv, g * t, -1), scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("nqs,nsd->nqd", probs, v.astype(dtype), preferred_element_type=f32)
        out = out.reshape(b, nkv, g, t, d)
        return out.transpose(1, 2, 4, 0, 3).reshape(c.num_attention_heads * d, b, t)

    def _attend_filled(self, q, k, v, mask, end):
        """`_attend` over the cache's first slots only: the smallest of its sizes (256 slots
        doubling up to the whole cache, and a chunk of several tokens' own length) that holds
        the `end` slots in use. `k` and `v` are the caches as stored (`jaxlm.memory.read_cache`
        reads them).

        Slots from `end` on are masked for every query, so leaving them out changes nothing
        but the work: a 128-token prompt in a plan of 4096 slots decoded 1.5x slower when
        attention read the whole cache, and a prompt's first chunk of 128 tokens in a plan of
        256 slots prefilled at 993 instead of 920-935 tok/s over its own slots (cold compile
        4.2-4.5 -> 4.6 s).
        """
        seq, t = k.shape[-1], q.shape[-1]
        sizes = [s for s in (FILLED_BUCKET << i for i in range(seq.bit_length())) if s < seq]
        if 1 < t < (sizes or [seq])[0]:
            # The first chunk of a prompt fills only its own slots.
            sizes.insert(0, t)
        if not sizes:
            return self._attend(q, read_cache(k), read_cache(v), mask)
        sizes.append(seq)

        def attend(size, q, k, v, mask):
            # The caches enter in their storage dtype and are read inside the branch: bf16
            # caches stored as uint16 and read before the branch made XLA copy each cache
            # twice per step, to hold both the updated bits and their bf16 view.
            k, v = read_cache(k[..., :size]), read_cache(v[:, :size])
            return self._attend(q, k, v, mask[..., :size])

        branch = jnp.searchsorted(jnp.asarray(sizes), end)
        branches = [functools.partial(attend, size) for size in sizes]
        return jax.lax.switch(branch, branches, q, k, v, mask)

    def __call__(self, x, cos, sin, mask):
        return self.o_proj(self._attend(*self._project(x, cos, sin), mask))

    def forward_cached(self, x, cos, sin, mask, index, scratch):
        q, k, v = self._project(x, cos, sin)
        k_cache = write_cache(scratch["k_cache"], k, index, axis=2)
        v_cache = write_cache(scratch["v_cache"], v, index, axis=1)
        end = index + x.shape[-1]
        out = self._attend_filled(q, k_cache, v_cache, mask, end)
        return self.o_proj(out), {"k_cache": k_cache, "v_cache": v_cache}


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
# all of them (SmolLM2's prefill: tracing 0.29 s to 0.13 s, lowering 0.25 s to 0.12 s). XLA
# inlines the calls, and the compiled step is the same.
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
        `jaxlm.layers.matmul`)."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.config, positions)
        mask = self._mask(positions, positions, attention_mask)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def _rope_once(self, positions):
        # XLA:CPU fuses `cos` and `sin` into each consumer, the queries and keys of every layer,
        # and so computed them 60 times a step for SmolLM2 (2.3 ms of an 80 ms decode step at
        # batch 8, 8 ms of a 140 ms prefill of 128 tokens). A conditional's results are
        # materialised, so they are computed once here, under a predicate that XLA cannot fold
        # (it removes optimization barriers, and a prompt of one chunk starts at the constant
        # slot 0). A chunk that is padding in every row, masked everywhere, is not rotated.
        def identity(positions):
            shape = (self.config.head_dim, *positions.shape)
            return jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)

        return jax.lax.cond(
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
            logits = self.model.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        # The barrier keeps XLA from making the transposed product a product of the transposed
        # operands, with a 16-bit weight on the right and the activations transposed on the
        # left, which XLA:CPU's YNNPACK declines and its own dot cannot run.
        return jnp.moveaxis(jax.lax.optimization_barrier(logits), 0, -1)

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
