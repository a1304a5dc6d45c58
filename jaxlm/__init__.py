"""jaxlm: Llama-family language models in JAX and Flax NNX, with a static memory plan."""

from jaxlm.config import ModelConfig
from jaxlm.errors import JaxlmError, LoadError, PlanError
from jaxlm.loading import load
from jaxlm.memory import ScratchSpec
from jaxlm.models.llama import LlamaForCausalLM
from jaxlm.tokenizer import Tokenizer

__all__ = [
    "JaxlmError",
    "LlamaForCausalLM",
    "LoadError",
    "ModelConfig",
    "PlanError",
    "ScratchSpec",
    "Tokenizer",
    "load",
]
