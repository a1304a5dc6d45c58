"""OLMo 2: Llama's attention and MLP with norms after them, on the residual branch, and RMSNorm
over the whole q and k projections.

A layer computes `x + post_attention_layernorm(attn(x))`, then `x +
post_feedforward_layernorm(mlp(x))`: there is no norm on a layer's input. Everything else (the
caches, the plan's scratch, the forwards) is Llama's.
"""

from __future__ import annotations

from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.layers import RMSNorm
from jaxlm.models.llama import Attention, DecoderLayer, LlamaForCausalLM, LlamaModel


class Olmo2Attention(Attention):
    def _add_qk_norms(self, config: ModelConfig, dtype) -> None:
        # One norm over all heads of q, another over all heads of k.
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(config.num_attention_heads * config.head_dim, eps=eps, dtype=dtype)
        self.k_norm = RMSNorm(config.num_key_value_heads * config.head_dim, eps=eps, dtype=dtype)

    def _norm_qk(self, q, k):
        # q [heads, D, B, T] holds the heads in the checkpoint's row order (see
        # `Attention._project`), so flattening the heads gives `q_proj`'s rows.
        q = self.q_norm(q.reshape(-1, *q.shape[2:])).reshape(q.shape)
        k = self.k_norm(k.reshape(-1, *k.shape[2:])).reshape(k.shape)
        return q, k


class Olmo2DecoderLayer(DecoderLayer):
    attention_class = Olmo2Attention

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        eps, h = config.rms_norm_eps, config.hidden_size
        self.self_attn = self.attention_class(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, dtype=dtype)
        self.mlp = self.mlp_class(config, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = RMSNorm(h, eps=eps, dtype=dtype)

    def _attention_input(self, x):
        return x

    def _attention_output(self, h):
        return self.post_attention_layernorm(h)

    def _feed_forward(self, x):
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    """An OLMo 2 causal language model (`model_type` `olmo2`), used as `LlamaForCausalLM` is.

    Example:
        >>> model, tokenizer = jaxlm.load("path/to/OLMo-2-0425-1B")
        >>> jaxlm.generate(model, tokenizer, "Language models are", max_new_tokens=16)[0].text
    """

    model_class = Olmo2Model
