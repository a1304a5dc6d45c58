"""Sparse mixtures of experts: Mixtral and Qwen3-MoE.

Llama's decoder whose MLP is a mixture of `num_experts` gated MLPs (SwiGLU) of
`moe_intermediate_size`. A router (`gate`, hidden -> experts) scores the experts for each
token; the softmax of the scores over all experts weighs the token's `num_experts_per_tok` best,
renormalised over them where `norm_topk_prob` (always in Mixtral), and the token's output is the
weighted sum of those experts' outputs. There is no shared expert. Qwen3-MoE adds Qwen3's RMSNorm
on each head of q and k; Mixtral attends over Mistral's sliding window where it sets one.

A layer's experts are stacked as transformers 5 holds them: `experts.gate_up_proj` `[experts,
2 * moe_intermediate, hidden]` (each expert's gate rows, then its up rows) and
`experts.down_proj` `[experts, hidden, moe_intermediate]`. The Hub's checkpoints, one tensor per
expert, join into them as they load (see `jaxlm.loading.names.PER_EXPERT`). Whether the products
gather the chosen experts or multiply all of them is `jaxlm.ops.expert_products`'s choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import ops
from jaxlm.config import ModelConfig
from jaxlm.layers import Linear, _normal
from jaxlm.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel


class Experts(nnx.Module):
    """The stacked weights of a layer's experts, split over the `experts` axis on a mesh and
    stored as `jaxlm.ops.expert_storage` chooses."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(dtype)
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        axes = ("experts", None, None)
        for name, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
            weight = ops.expert_storage(_normal(rngs, shape, dtype))
            setattr(self, name, nnx.Param(weight, axes=axes))


class SparseMoeBlock(nnx.Module):
    """The router (`gate`) and the experts of one layer."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.gate = Linear(
            config.hidden_size, config.num_experts, bias=False, dtype=dtype, rngs=rngs
        )
        self.experts = Experts(config, dtype=dtype, rngs=rngs)

    def _route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each token's chosen experts and their weights, `[N, top_k]` each, for `x`
        `[hidden, N]`."""
        c = self.config
        f32, dtype = jnp.float32, self.experts.dtype
        # transformers computes the scores in the model's dtype and their softmax in float32;
        # rounded alike, the same experts win in bfloat16 too.
        scores = self.gate(x).astype(dtype).astype(f32)
        weight, index = jax.lax.top_k(jax.nn.softmax(scores.T, axis=-1), c.num_experts_per_tok)
        if c.norm_topk_prob:
            weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
        if c.model_type == "qwen3_moe":
            # Qwen3-MoE rounds the weights to the model's dtype, Mixtral keeps them in float32.
            weight = weight.astype(dtype).astype(f32)
        return index, weight

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x` `[hidden, ...]` (feature-major) -> `[hidden, ...]`."""
        flat = x.reshape(x.shape[0], -1)
        index, weight = self._route(flat)
        e = self.experts
        gate_up, down = e.gate_up_proj[...], e.down_proj[...]
        y = ops.expert_products(flat, gate_up, down, index, weight, jax.nn.silu, e.dtype)
        return y.reshape(x.shape)


class MoeDecoderLayer(DecoderLayer):
    mlp_class = SparseMoeBlock


class MoeModel(LlamaModel):
    layer_class = MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """A Mixtral causal language model (`model_type` `mixtral`), used as `LlamaForCausalLM` is.

    Example:
        >>> model, tokenizer = jaxlm.load("path/to/Mixtral-8x7B-v0.1", dtype=jnp.bfloat16)
        >>> jaxlm.generate(model, tokenizer, "The capital of France is", max_new_tokens=16)[0].text
    """

    model_class = MoeModel


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """A Qwen3-MoE causal language model (`model_type` `qwen3_moe`), used as `LlamaForCausalLM`
    is.

    Example:
        >>> model, tokenizer = jaxlm.load("path/to/Qwen3-30B-A3B", dtype=jnp.bfloat16)
        >>> jaxlm.generate(model, tokenizer, "The capital of France is", max_new_tokens=16)[0].text
    """

    model_class = MoeModel
