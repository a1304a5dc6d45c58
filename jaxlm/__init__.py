"""jaxlm: decoder language models in JAX and Flax NNX, with a static memory plan.

Example:
    >>> import jaxlm
    >>> model, tokenizer = jaxlm.load()
    >>> out = jaxlm.generate(model, tokenizer, "The capital of France is", max_new_tokens=16)
    >>> out[0].text
"""

from jaxlm.batching.engine import EngineStats, LLMEngine
from jaxlm.batching.handle import RequestHandle
from jaxlm.config import ModelConfig
from jaxlm.diagnostics import CompileCounter
from jaxlm.errors import JaxlmError, LoadError, PlanError
from jaxlm.generate import chat, generate, stream
from jaxlm.loading import load
from jaxlm.memory import ScratchSpec
from jaxlm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from jaxlm.models.llama import LlamaForCausalLM
from jaxlm.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from jaxlm.models.olmo2 import Olmo2ForCausalLM
from jaxlm.models.phi3 import Phi3ForCausalLM
from jaxlm.outputs import Delta, RequestOutput, TokenLogprob
from jaxlm.planner import Plan, plan
from jaxlm.plans import GenerationPlans, plans_of
from jaxlm.quantization import quantize
from jaxlm.requests import SamplingParams
from jaxlm.sharding import ShardingError, shard
from jaxlm.tokenizer import Tokenizer

__all__ = [
    "CompileCounter",
    "Delta",
    "EngineStats",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GenerationPlans",
    "JaxlmError",
    "LLMEngine",
    "LlamaForCausalLM",
    "LoadError",
    "MixtralForCausalLM",
    "ModelConfig",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "Plan",
    "PlanError",
    "Qwen3MoeForCausalLM",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "ScratchSpec",
    "ShardingError",
    "TokenLogprob",
    "Tokenizer",
    "chat",
    "generate",
    "load",
    "plan",
    "plans_of",
    "quantize",
    "shard",
    "stream",
]
