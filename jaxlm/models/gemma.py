"""Gemma 2 and 3. Gemma 2: Llama's decoder with GeGLU, four norms per layer scaled by `1 +
weight`, embeddings scaled by `sqrt(hidden)`, soft-capped attention scores and logits, and
sliding-window layers alternating with full ones.

A layer computes `x + post_attention_layernorm(attn(input_layernorm(x)))`, then `x +
post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`. Queries are scaled by
`query_pre_attn_scalar ** -0.5` rather than by the head size. Each layer's mask follows its
entry in `layer_types`; the caches of sliding layers are as long as the others (the plan sizes
every layer's cache by `max_seq_len`).

Gemma 3 drops the attention soft-cap and adds a `1 + weight` RMSNorm on each head of q and k;
its sliding layers rotate with their own base, `rope_local_base_freq`, unscaled, and its full
layers with `rope_theta` and `rope_scaling`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.config_fields import RopeScaling
from jaxlm.layers import GeGLU, RMSNorm
from jaxlm.models.llama import Attention, DecoderLayer, LlamaForCausalLM, LlamaModel


def _softcap(x, cap: float | None):
    return x if cap is None else cap * jnp.tanh(x / cap)


class GemmaAttention(Attention):
    def _attend_options(self) -> dict:
        c = self.config
        return {"scale": c.query_pre_attn_scalar**-0.5, "softcap": c.attn_logit_softcapping}


class GemmaDecoderLayer(DecoderLayer):
    attention_class = GemmaAttention
    mlp_class = GeGLU

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        norm = functools.partial(
            RMSNorm, config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, offset=1.0
        )
        self.input_layernorm = norm()
        self.self_attn = self.attention_class(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = self.mlp_class(config, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = norm()

    def _attention_output(self, h):
        return self.post_attention_layernorm(h)

    def _feed_forward(self, x):
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    layer_class = GemmaDecoderLayer
    norm_offset = 1.0

    def _embed(self, input_ids):
        # transformers rounds the factor to the weights' dtype before it multiplies.
        scale = jnp.asarray(math.sqrt(self.config.hidden_size), self.embed_tokens.dtype)
        return self.embed_tokens(input_ids) * scale.astype(jnp.float32)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """A Gemma 2 causal language model (`model_type` `gemma2`), used as `LlamaForCausalLM` is.

    Example:
        >>> model, tokenizer = jaxlm.load("path/to/gemma-2-2b")
        >>> jaxlm.generate(model, tokenizer, "The capital of France is", max_new_tokens=16)[0].text
    """

    model_class = GemmaModel

    def _logits(self, x):
        return _softcap(super()._logits(x), self.config.final_logit_softcapping)


class Gemma3Attention(GemmaAttention):
    def _add_qk_norms(self, config: ModelConfig, dtype) -> None:
        # Per head, as Qwen3's, but scaled by `1 + weight` as Gemma's other norms.
        norm = functools.partial(
            RMSNorm, config.head_dim, eps=config.rms_norm_eps, dtype=dtype, offset=1.0
        )
        self.q_norm, self.k_norm = norm(), norm()


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_class = Gemma3Attention


class Gemma3Model(GemmaModel):
    layer_class = Gemma3DecoderLayer

    def _rope_config(self, layer_type: str) -> ModelConfig:
        if layer_type == "sliding_attention":
            return dataclasses.replace(
                self.config, rope_theta=self.config.rope_local_base_freq, rope_scaling=RopeScaling()
            )
        return self.config


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """A Gemma 3 text model (`model_type` `gemma3_text`), used as `LlamaForCausalLM` is.

    Example:
        >>> model, tokenizer = jaxlm.load("path/to/gemma-3-1b-it")
        >>> jaxlm.generate(model, tokenizer, "The capital of France is", max_new_tokens=16)[0].text
    """

    model_class = Gemma3Model
