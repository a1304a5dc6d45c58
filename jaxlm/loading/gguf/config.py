"""A Hugging Face style config from a GGUF file's metadata, rope scaling included."""

from __future__ import annotations

import math
import pathlib

import numpy as np
from gguf import GGMLQuantizationType

from jaxlm.errors import LoadError
from jaxlm.loading.gguf.reader import _float, _Metadata
from jaxlm.loading.gguf.tensors import _ROPE_FACTORS, _ROPE_FREQS, _hf_shape

# Hugging Face's `model_type` for each `general.architecture` jaxlm reads.
_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "olmo2": "olmo2",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "qwen3moe": "qwen3_moe",
}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# llama.cpp's converter permutes the Q and K rows of these architectures only.
_PERMUTED_QK = frozenset({"llama"})

# The rope frequency factors of Llama 3.1 and 3.2 that `rope_freqs.weight` can hold, as
# (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
_LLAMA3_ROPE_CANDIDATES = ((1.0, 4.0, 8192),)


def _config(meta: _Metadata, arch: str, tensors: dict, tokens: list | None) -> dict:
    path = meta.path
    hidden = meta.int_value(f"{arch}.embedding_length")
    heads = meta.int_value(f"{arch}.attention.head_count")
    kv_heads = meta.int_value(f"{arch}.attention.head_count_kv", heads)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise LoadError(
            f"{path}: `{arch}.attention.head_count` ({heads}) is not a positive multiple of "
            f"`{arch}.attention.head_count_kv` ({kv_heads})"
        )
    head_dim = meta.int_value(f"{arch}.attention.key_length", None)
    if head_dim is None:
        if hidden % heads:
            raise LoadError(
                f"{path}: `{arch}.embedding_length` ({hidden}) is not a multiple of "
                f"`{arch}.attention.head_count` ({heads})"
            )
        head_dim = hidden // heads
    value_dim = meta.int_value(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise LoadError(
            f"{path}: `{arch}.attention.value_length` ({value_dim}) differs from the key length "
            f"({head_dim}), unsupported"
        )
    rope_dim = meta.int_value(f"{arch}.rope.dimension_count", head_dim)
    # Phi-4-mini rotates part of each head.
    if rope_dim != head_dim and arch != "phi3":
        raise LoadError(
            f"{path}: `{arch}.rope.dimension_count` ({rope_dim}) is not the head size "
            f"({head_dim}); partial rotary embeddings are unsupported"
        )

    if f"{arch}.vocab_size" in meta:
        vocab_size = meta.int_value(f"{arch}.vocab_size")
    elif tokens:
        vocab_size = len(tokens)
    elif "token_embd.weight" in tensors:
        vocab_size = _hf_shape(tensors["token_embd.weight"])[0]
    else:
        raise LoadError(f"{path}: no `token_embd.weight` tensor")
    if tokens is not None and len(tokens) > vocab_size:
        raise LoadError(
            f"{path}: `tokenizer.ggml.tokens` has {len(tokens)} tokens, more than the vocabulary "
            f"size {vocab_size}"
        )

    rope_theta = meta.float_value(f"{arch}.rope.freq_base", 10000.0)
    config = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": _ARCHITECTURES[arch],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.int_value(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.int_value(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": meta.float_value(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(meta, arch, tensors, rope_theta, head_dim),
        "max_position_embeddings": meta.int_value(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.int_value("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta.int_value("tokenizer.ggml.eos_token_id", None),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
    }
    if arch in _GEMMA:
        config |= _gemma_settings(meta, arch, config)
    if arch == "phi3":
        config |= _phi3_settings(meta, config, rope_dim)
    experts = meta.int_value(f"{arch}.expert_count", 0)
    if experts:
        config |= _moe_settings(meta, arch, experts)
    return config


def _moe_settings(meta: _Metadata, arch: str, experts: int) -> dict:
    """A mixture of experts' settings as llama.cpp reads them: Mixtral is `llama` with
    experts, and both architectures renormalise the chosen experts' weights."""
    settings = {
        "num_local_experts": experts,
        "num_experts_per_tok": meta.int_value(f"{arch}.expert_used_count"),
        "norm_topk_prob": True,
    }
    if arch == "llama":
        return settings | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    return settings | {
        "moe_intermediate_size": meta.int_value(f"{arch}.expert_feed_forward_length")
    }


# For each Gemma architecture, the layers of its 27B model and every how many layers one is full.
_GEMMA = {"gemma2": (46, 2), "gemma3": (62, 6)}


def _gemma_settings(meta: _Metadata, arch: str, config: dict) -> dict:
    """Gemma's settings as llama.cpp reads them: each pattern's last layer full, the others
    sliding; the query scale is the head size's, but for the 27B models that of `hidden /
    heads`, the one they were trained with. Gemma 3's sliding layers rotate with their own base
    and no soft-caps."""
    layers = config["num_hidden_layers"]
    large, pattern = _GEMMA[arch]
    scalar = config["head_dim"]
    if layers == large:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    settings = {
        "hidden_act": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": meta.int_value(f"{arch}.attention.sliding_window", 4096),
        "layer_types": [
            ("full_attention", "sliding_attention")[bool((i + 1) % pattern)] for i in range(layers)
        ],
        "query_pre_attn_scalar": scalar,
    }
    if arch == "gemma3":
        return settings | {
            "rope_local_base_freq": meta.float_value("gemma3.rope.freq_base_swa", 10000.0)
        }
    return settings | {
        "attn_logit_softcapping": meta.float_value("gemma2.attn_logit_softcapping", None),
        "final_logit_softcapping": meta.float_value("gemma2.final_logit_softcapping", None),
    }


def _phi3_settings(meta: _Metadata, config: dict, rope_dim: int) -> dict:
    """Phi-3's settings as llama.cpp's converter writes them: the rotating share of each head,
    the context LongRoPE was trained for, and a sliding window, 0 for none (Phi-4)."""
    return {
        "partial_rotary_factor": rope_dim / config["head_dim"],
        "original_max_position_embeddings": meta.int_value(
            "phi3.rope.scaling.original_context_length", config["max_position_embeddings"]
        ),
        "sliding_window": meta.int_value("phi3.attention.sliding_window", 0) or None,
    }


def _longrope_scaling(meta: _Metadata, arch: str, tensors: dict) -> dict:
    """LongRoPE from the factors llama.cpp's converter stores as tensors (`_ROPE_FACTORS`) and
    its attention factor, which the converter computes as transformers does by default."""
    scaling = {"rope_type": "longrope"}
    for name, key in zip(_ROPE_FACTORS, ("short_factor", "long_factor"), strict=True):
        tensor = tensors.get(name)
        if tensor is None or tensor.tensor_type != GGMLQuantizationType.F32:
            raise LoadError(f"{meta.path}: LongRoPE needs tensor `{name}` in F32")
        scaling[key] = np.asarray(tensor.data, dtype=np.float32).reshape(-1).tolist()
    attention = meta.float_value(f"{arch}.rope.scaling.attn_factor", None)
    if attention is not None:
        scaling["attention_factor"] = attention
    return scaling


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict, theta: float, head_dim: int):
    path = meta.path
    if any(name in tensors for name in _ROPE_FACTORS):
        return _longrope_scaling(meta, arch, tensors)
    if _ROPE_FREQS in tensors:
        return _llama3_rope_scaling(path, tensors[_ROPE_FREQS], theta, head_dim)
    kind = meta.str_value(f"{arch}.rope.scaling.type", None)
    factor = meta.float_value(f"{arch}.rope.scaling.factor", None)
    if kind is None:
        # Files from before `rope.scaling.type` existed give a linear factor this way.
        factor = meta.float_value(f"{arch}.rope.scale_linear", None)
        kind = "none" if factor is None or factor == 1.0 else "linear"
    if kind == "none":
        return None
    if factor is None:
        raise LoadError(f"{path}: `{arch}.rope.scaling.type` is `{kind}` but no factor is given")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": meta.int_value(
                f"{arch}.rope.scaling.original_context_length"
            ),
        }
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = meta.float_value(f"{arch}.rope.scaling.{key}", None)
            if value is not None:
                scaling[hf_key] = value
        return scaling
    raise LoadError(f"{path}: unsupported rope scaling `{kind}` (`{arch}.rope.scaling.type`)")


def _llama3_rope_scaling(path: pathlib.Path, tensor, theta: float, head_dim: int) -> dict:
    """The Hugging Face `llama3` rope scaling whose frequency factors `rope_freqs.weight` holds.

    llama.cpp's converter bakes Llama 3.1's rope scaling into per-frequency factors; the
    parameters are recovered by recomputing the factors for the ones Llama 3.x uses.
    """
    unsupported = LoadError(
        f"{path}: tensor `{_ROPE_FREQS}` holds rope frequency factors that match no Llama 3 "
        "rope scaling jaxlm supports"
    )
    if tensor.tensor_type != GGMLQuantizationType.F32 or _hf_shape(tensor) != (head_dim // 2,):
        raise unsupported
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    factor = float(factors.max())
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    for low, high, context in _LLAMA3_ROPE_CANDIDATES:
        smooth = (context / wavelen - low) / (high - low)
        expected = np.where(
            wavelen < context / high,
            1.0,
            np.where(wavelen > context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(factors, expected, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": _float(factor),
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": context,
            }
    raise unsupported
