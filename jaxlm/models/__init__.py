"""The model families, one file each, and the registry that builds a config's model."""

from __future__ import annotations

from jaxlm.config import ModelConfig
from jaxlm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from jaxlm.models.llama import LlamaForCausalLM
from jaxlm.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from jaxlm.models.olmo2 import Olmo2ForCausalLM
from jaxlm.models.phi3 import Phi3ForCausalLM

# The class of each `model_type` that `ModelConfig` accepts.
MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds `config`'s model.

    Example:
        >>> model = model_class(config).abstract(config, dtype=jnp.bfloat16)
    """
    return MODEL_CLASSES[config.model_type]
