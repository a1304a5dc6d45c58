"""The fields of a Hugging Face `config.json` as `ModelConfig` reads them: each checked, with
a `LoadError` naming it, and the RoPE and mixture-of-experts settings of each convention."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxlm.errors import LoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in `rope_scaling` / `rope_parameters` of `config.json`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # LongRoPE: each frequency's divisor for short and for long sequences, and the scale of
    # `cos` and `sin` (see `jaxlm.layers.rope_cos_sin`).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


def moe_settings(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a mixture of experts (none for a dense `model_type`).

    Mixtral renormalises the chosen experts' weights, Qwen3-MoE where `norm_topk_prob`. The
    key of the expert count is `num_local_experts` in Mixtral's configs and in those
    transformers 5 writes, `num_experts` in Qwen3-MoE's on the Hub.
    """
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    if model_type == "qwen3_moe":
        # Layers with a dense MLP instead of experts.
        if value_or(config, "decoder_sparse_step", 1) != 1:
            raise LoadError("Qwen3-MoE `decoder_sparse_step` other than 1 is not supported")
        if value_or(config, "mlp_only_layers", []):
            raise LoadError("Qwen3-MoE `mlp_only_layers` are not supported")
    key = "num_local_experts" if "num_local_experts" in config else "num_experts"
    experts = positive_int(config.get(key), key)
    top_k = positive_int(config.get("num_experts_per_tok"), "num_experts_per_tok")
    if top_k > experts:
        raise LoadError(f"`num_experts_per_tok` ({top_k}) exceeds `{key}` ({experts})")
    mixtral = model_type == "mixtral"
    inter = "intermediate_size" if mixtral else "moe_intermediate_size"
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": mixtral or flag(config, "norm_topk_prob"),
        "moe_intermediate_size": positive_int(config.get(inter), inter),
    }


def positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LoadError(f"`{name}` must be a positive integer, got {value!r}")
    return value


def token_id(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LoadError(f"`{name}` must be a token id (an integer >= 0), got {value!r}")
    return value


def flag(config: dict[str, Any], name: str) -> bool:
    value = value_or(config, name, False)
    # Some older configs write flags as 0 and 1.
    if value not in (True, False) or not isinstance(value, bool | int):
        raise LoadError(f"`{name}` must be true or false, got {value!r}")
    return bool(value)


def value_or(config: dict[str, Any], name: str, default):
    value = config.get(name)
    return default if value is None else value


def int_div(a: int, b: int, name: str) -> int:
    if a % b:
        raise LoadError(f"`{name}` ({a}) is not divisible by `num_attention_heads` ({b})")
    return a // b


def number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LoadError(f"`{name}` must be a finite number, got {value!r}")
    return float(value)


def optional_number(config: dict[str, Any], name: str, read: bool) -> float | None:
    """`config[name]` as a positive number, or None where absent or not `read` (a family
    without the setting)."""
    value = config.get(name) if read else None
    if value is None:
        return None
    value = number(value, name)
    if not value > 0:
        raise LoadError(f"`{name}` must be positive, got {value!r}")
    return value


def gemma3_rope(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's RoPE: `config` with the full layers' settings where `rope_settings` reads
    them, and the sliding layers' base, from transformers 5's `rope_parameters` keyed by layer
    type or from the older `rope_theta`, `rope_scaling` and `rope_local_base_freq`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= set(LAYER_TYPES):
        sliding = params.get("sliding_attention") or {}
        full = params.get("full_attention") or {"rope_type": "default"}
        for name, value in (("sliding_attention", sliding), ("full_attention", full)):
            if not isinstance(value, dict):
                raise LoadError(f"`rope_parameters.{name}` must be a JSON object, got {value!r}")
        if sliding.get("rope_type", "default") != "default":
            raise LoadError(
                "unsupported `rope_parameters.sliding_attention.rope_type` "
                f"{sliding['rope_type']!r}; only `default`"
            )
        local = sliding.get("rope_theta", 10000.0)
        full = {"rope_type": "default", "rope_theta": value_or(config, "rope_theta", 1e6), **full}
        config = {**config, "rope_parameters": full}
    else:
        local = value_or(config, "rope_local_base_freq", 10000.0)
        config = {**config, "rope_theta": value_or(config, "rope_theta", 1e6)}
    local = number(local, "rope_local_base_freq")
    if not local > 0:
        raise LoadError(f"`rope_local_base_freq` must be positive, got {local!r}")
    return config, local


def rope_settings(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = config.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = config.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise LoadError(f"`{key}` must be a JSON object, got {params!r}")
    if key == "rope_parameters" and "rope_theta" not in params and "rope_type" not in params:
        raise LoadError("per-layer-type `rope_parameters` are not supported")
    params = dict(params or {})
    theta = number(params.get("rope_theta", config.get("rope_theta", 10000.0)), "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise LoadError(
            f"unsupported RoPE scaling type {rope_type!r}; jaxlm supports "
            + ", ".join(f"`{t}`" for t in SUPPORTED_ROPE_TYPES)
        )
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "longrope":
        return theta, longrope(config, params)
    if "factor" not in params:
        raise LoadError(f"RoPE scaling `{rope_type}` needs a `factor`")
    original = params.get("original_max_position_embeddings")
    if original is not None:
        positive_int(original, "original_max_position_embeddings")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=number(params["factor"], "factor"),
        low_freq_factor=number(params.get("low_freq_factor", 1.0), "low_freq_factor"),
        high_freq_factor=number(params.get("high_freq_factor", 4.0), "high_freq_factor"),
        original_max_position_embeddings=original,
    )
    if not scaling.factor > 0:
        raise LoadError(f"RoPE scaling `factor` must be positive, got {scaling.factor!r}")
    if rope_type == "llama3":
        if original is None:
            raise LoadError("RoPE scaling `llama3` needs `original_max_position_embeddings`")
        if not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
            raise LoadError(
                "RoPE scaling `llama3` needs 0 < `low_freq_factor` < `high_freq_factor`, got "
                f"{scaling.low_freq_factor!r} and {scaling.high_freq_factor!r}"
            )
    return theta, scaling


def longrope(config: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """LongRoPE's settings as transformers computes them: the top-level
    `original_max_position_embeddings` before the RoPE settings' own; `factor` by default
    `max_position_embeddings / original_max_position_embeddings`, and the scale of `cos` and
    `sin`, `attention_factor`, by default `sqrt(1 + log(factor) / log(original))` (1 where
    `factor` <= 1)."""
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, list) or not values:
            raise LoadError(f"RoPE scaling `longrope` needs `{name}`, a list of numbers")
        factors[name] = tuple(number(v, name) for v in values)
        if not all(v > 0 for v in factors[name]):
            raise LoadError(f"RoPE scaling `{name}` must be positive, got {values!r}")
    max_len = value_or(config, "max_position_embeddings", 2048)
    original = positive_int(
        value_or(
            config,
            "original_max_position_embeddings",
            value_or(params, "original_max_position_embeddings", max_len),
        ),
        "original_max_position_embeddings",
    )
    factor = params.get("factor")
    factor = max_len / original if factor is None else number(factor, "factor")
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    attention = number(attention, "attention_factor")
    if not attention > 0:
        raise LoadError(f"RoPE scaling `attention_factor` must be positive, got {attention!r}")
    return RopeScaling(
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=attention,
        **factors,
    )


def phi3_config(config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's config as transformers' `Phi3Config` reads it: RoPE `default` or `longrope`
    (which older configs call `su` or `yarn`), `original_max_position_embeddings` 4096 where
    the config leaves it out, and `partial_rotary_factor` from the RoPE settings or else the top
    level. Phi-3 has no biases; a config that asks for them is refused."""
    for name in ("attention_bias", "mlp_bias", "lm_head_bias"):
        if flag(config, name):
            raise LoadError(f"Phi-3 `{name}` is not supported")
    key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    params = config.get(key) or {}
    if not isinstance(params, dict):
        raise LoadError(f"`{key}` must be a JSON object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type
    if rope_type not in ("default", "longrope"):
        raise LoadError(
            f"unsupported RoPE scaling type {rope_type!r} for Phi-3; only `default` and `longrope`"
        )
    partial = params.get("partial_rotary_factor", value_or(config, "partial_rotary_factor", 1.0))
    return {
        "original_max_position_embeddings": 4096,
        **config,
        key: {**params, "rope_type": rope_type},
        "partial_rotary_factor": number(partial, "partial_rotary_factor"),
    }
