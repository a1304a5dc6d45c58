"""Model configuration: a frozen dataclass whose fields are Hugging Face `config.json` keys."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxlm.errors import LoadError

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen3_moe",
)
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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Configuration of a decoder: Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2/3, OLMo 2, Gemma 2
    and 3, Phi-3.

    Field names are the keys of a Hugging Face `config.json`. Build one with `from_hf_config`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Each layer's attention, `"full_attention"` or `"sliding_attention"` (over
    # `sliding_window`); without it every layer's is the same (see `attention_layer_types`).
    layer_types: tuple[str, ...] | None = None
    # Gemma: the query scale is `query_pre_attn_scalar ** -0.5`; scores and logits are capped
    # to `cap * tanh(x / cap)` where a cap is set.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the RoPE base of the sliding layers, which take no scaling; the full layers use
    # `rope_theta` and `rope_scaling`.
    rope_local_base_freq: float | None = None
    # Phi-3: the fraction of each head's features that rotate (see `rotary_dim`).
    partial_rotary_factor: float = 1.0
    # Mixtral and Qwen3-MoE: each layer's MLP is `num_experts` experts of
    # `moe_intermediate_size`, of which each token takes `num_experts_per_tok` (see
    # `jaxlm.models.moe`); none in a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _positive_int(getattr(self, name), name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise LoadError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise LoadError(f"`head_dim` must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise LoadError(f"`rope_theta` must be positive, got {self.rope_theta!r}")
        if not self.rms_norm_eps >= 0:
            raise LoadError(f"`rms_norm_eps` must be >= 0, got {self.rms_norm_eps!r}")
        if self.sliding_window is not None:
            _positive_int(self.sliding_window, "sliding_window")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise LoadError(
                    f"`layer_types` has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise LoadError(f"unsupported `layer_types` {sorted(unknown)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise LoadError("`layer_types` has sliding layers but no `sliding_window`")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise LoadError(
                f"`partial_rotary_factor` {self.partial_rotary_factor!r} must rotate an even, "
                f"nonzero number of the {self.head_dim} features of a head"
            )
        scaling = self.rope_scaling
        if scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise LoadError(
                        f"RoPE scaling `{name}` has {len(getattr(scaling, name))} entries, the "
                        f"rotary embedding {self.rotary_dim // 2} frequencies"
                    )
        if self.bos_token_id is not None:
            _token_id(self.bos_token_id, "bos_token_id")
        for token in self.eos_token_id:
            _token_id(token, "eos_token_id")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        """How many of each head's leading features rotate, as transformers rounds them."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_types(self) -> tuple[str, ...]:
        """Each layer's attention: `layer_types`, or every layer sliding where a window is
        set (Mistral) and full otherwise."""
        if self.layer_types is not None:
            return self.layer_types
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return (kind,) * self.num_hidden_layers

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelConfig:
        """Build a config from a Hugging Face `config.json` dict; unknown keys are ignored.

        Accepts both shapes of RoPE settings: top-level `rope_theta` / `rope_scaling` (checkpoints
        made before transformers 5) and `rope_parameters` (transformers 5).

        Example:
            >>> ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 32, ...})
        """
        if not isinstance(config, dict):
            raise LoadError(f"a model config must be a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LoadError(
                f"unsupported `model_type` {model_type!r}; jaxlm supports "
                + ", ".join(f"`{t}`" for t in SUPPORTED_MODEL_TYPES)
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [key for key in required if key not in config]
        if missing:
            raise LoadError("the model config lacks " + ", ".join(f"`{k}`" for k in missing))
        gemma = model_type in ("gemma2", "gemma3_text")
        gemma3 = model_type == "gemma3_text"
        if gemma3 and config.get("use_bidirectional_attention"):
            raise LoadError("Gemma 3 `use_bidirectional_attention` is not supported")
        if gemma:
            # transformers' default where a config leaves it out.
            config = {"query_pre_attn_scalar": 256, **config}
            if config.get("hidden_activation") != "gelu_pytorch_tanh":
                raise LoadError(
                    f"unsupported `hidden_activation` {config.get('hidden_activation')!r}; "
                    "only `gelu_pytorch_tanh`"
                )
        elif config.get("hidden_act", "silu") != "silu":
            raise LoadError(f"unsupported `hidden_act` {config['hidden_act']!r}; only `silu`")
        if config.get("pretraining_tp", 1) != 1:
            raise LoadError("`pretraining_tp` other than 1 is not supported")
        heads = _positive_int(config["num_attention_heads"], "num_attention_heads")
        head_dim = config.get("head_dim") or _int_div(
            _positive_int(config["hidden_size"], "hidden_size"), heads, "hidden_size"
        )
        local_theta = None
        if gemma3:
            config, local_theta = _gemma3_rope(config)
        phi3 = model_type == "phi3"
        if phi3:
            config = _phi3_config(config)
        rope_theta, scaling = _rope_settings(config)
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise LoadError("Qwen2 `use_sliding_window` is not supported")
        if model_type in ("qwen3", "qwen3_moe") and config.get("use_sliding_window"):
            raise LoadError("Qwen3 `use_sliding_window` is not supported")
        windowed = model_type in ("mistral", "phi3", "mixtral") or gemma
        sliding_window = config.get("sliding_window") if windowed else None
        layer_types = config.get("layer_types")
        if gemma and layer_types is None:
            # transformers' default: every `sliding_window_pattern`-th layer is full, the others
            # sliding (Gemma 2 alternates them).
            layers = _positive_int(config["num_hidden_layers"], "num_hidden_layers")
            pattern = 2
            if gemma3:
                pattern = _positive_int(
                    _default(config, "sliding_window_pattern", 6), "sliding_window_pattern"
                )
            layer_types = [
                ("full_attention", "sliding_attention")[bool((i + 1) % pattern)]
                for i in range(layers)
            ]
        if layer_types is not None and not isinstance(layer_types, list):
            raise LoadError(f"`layer_types` must be a list, got {layer_types!r}")
        eos = config.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=_number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=_default(config, "max_position_embeddings", 2048),
            tie_word_embeddings=_bool(config, "tie_word_embeddings"),
            attention_bias=model_type == "qwen2" or _bool(config, "attention_bias"),
            mlp_bias=_bool(config, "mlp_bias"),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            sliding_window=sliding_window,
            layer_types=None if layer_types is None else tuple(layer_types),
            query_pre_attn_scalar=_optional_number(config, "query_pre_attn_scalar", gemma),
            # transformers' Gemma 3 leaves `attn_logit_softcapping` out of its attention.
            attn_logit_softcapping=_optional_number(
                config, "attn_logit_softcapping", model_type == "gemma2"
            ),
            final_logit_softcapping=_optional_number(config, "final_logit_softcapping", gemma),
            rope_local_base_freq=local_theta,
            partial_rotary_factor=config["partial_rotary_factor"] if phi3 else 1.0,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos,
            **_moe_settings(config, model_type),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a `config.json` file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise LoadError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_hf_config(data)
        except LoadError as e:
            raise LoadError(f"{path}: {e}") from None

    def num_parameters(self) -> int:
        """The parameter count computed from the config, as model cards publish it."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * d
        if self.model_type == "olmo2":
            attn += q + kv  # q and k norms over all heads
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        if self.num_experts:
            # The experts and the router.
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)
        layer = attn + mlp + (4 if self.model_type in ("gemma2", "gemma3_text") else 2) * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head


def _moe_settings(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a mixture of experts (none for a dense `model_type`).

    Mixtral renormalises the chosen experts' weights, Qwen3-MoE where `norm_topk_prob`. The
    key of the expert count is `num_local_experts` in Mixtral's configs and in those
    transformers 5 writes, `num_experts` in Qwen3-MoE's on the Hub.
    """
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    if model_type == "qwen3_moe":
        # Layers with a dense MLP instead of experts.
        if _default(config, "decoder_sparse_step", 1) != 1:
            raise LoadError("Qwen3-MoE `decoder_sparse_step` other than 1 is not supported")
        if _default(config, "mlp_only_layers", []):
            raise LoadError("Qwen3-MoE `mlp_only_layers` are not supported")
    key = "num_local_experts" if "num_local_experts" in config else "num_experts"
    experts = _positive_int(config.get(key), key)
    top_k = _positive_int(config.get("num_experts_per_tok"), "num_experts_per_tok")
    if top_k > experts:
        raise LoadError(f"`num_experts_per_tok` ({top_k}) exceeds `{key}` ({experts})")
    mixtral = model_type == "mixtral"
    inter = "intermediate_size" if mixtral else "moe_intermediate_size"
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": mixtral or _bool(config, "norm_topk_prob"),
        "moe_intermediate_size": _positive_int(config.get(inter), inter),
    }


def _positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LoadError(f"`{name}` must be a positive integer, got {value!r}")
    return value


def _token_id(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LoadError(f"`{name}` must be a token id (an integer >= 0), got {value!r}")
    return value


def _bool(config: dict[str, Any], name: str) -> bool:
    value = _default(config, name, False)
    # Some older configs write flags as 0 and 1.
    if value not in (True, False) or not isinstance(value, bool | int):
        raise LoadError(f"`{name}` must be true or false, got {value!r}")
    return bool(value)


def _default(config: dict[str, Any], name: str, default):
    value = config.get(name)
    return default if value is None else value


def _int_div(a: int, b: int, name: str) -> int:
    if a % b:
        raise LoadError(f"`{name}` ({a}) is not divisible by `num_attention_heads` ({b})")
    return a // b


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LoadError(f"`{name}` must be a finite number, got {value!r}")
    return float(value)


def _optional_number(config: dict[str, Any], name: str, read: bool) -> float | None:
    """`config[name]` as a positive number, or None where absent or not `read` (a family
    without the setting)."""
    value = config.get(name) if read else None
    if value is None:
        return None
    value = _number(value, name)
    if not value > 0:
        raise LoadError(f"`{name}` must be positive, got {value!r}")
    return value


def _gemma3_rope(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's RoPE: `config` with the full layers' settings where `_rope_settings` reads
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
        full = {"rope_type": "default", "rope_theta": _default(config, "rope_theta", 1e6), **full}
        config = {**config, "rope_parameters": full}
    else:
        local = _default(config, "rope_local_base_freq", 10000.0)
        config = {**config, "rope_theta": _default(config, "rope_theta", 1e6)}
    local = _number(local, "rope_local_base_freq")
    if not local > 0:
        raise LoadError(f"`rope_local_base_freq` must be positive, got {local!r}")
    return config, local


def _rope_settings(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = config.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = config.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise LoadError(f"`{key}` must be a JSON object, got {params!r}")
    if key == "rope_parameters" and "rope_theta" not in params and "rope_type" not in params:
        raise LoadError("per-layer-type `rope_parameters` are not supported")
    params = dict(params or {})
    theta = _number(params.get("rope_theta", config.get("rope_theta", 10000.0)), "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise LoadError(
            f"unsupported RoPE scaling type {rope_type!r}; jaxlm supports "
            + ", ".join(f"`{t}`" for t in SUPPORTED_ROPE_TYPES)
        )
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "longrope":
        return theta, _longrope(config, params)
    if "factor" not in params:
        raise LoadError(f"RoPE scaling `{rope_type}` needs a `factor`")
    original = params.get("original_max_position_embeddings")
    if original is not None:
        _positive_int(original, "original_max_position_embeddings")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=_number(params["factor"], "factor"),
        low_freq_factor=_number(params.get("low_freq_factor", 1.0), "low_freq_factor"),
        high_freq_factor=_number(params.get("high_freq_factor", 4.0), "high_freq_factor"),
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


def _longrope(config: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
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
        factors[name] = tuple(_number(v, name) for v in values)
        if not all(v > 0 for v in factors[name]):
            raise LoadError(f"RoPE scaling `{name}` must be positive, got {values!r}")
    max_len = _default(config, "max_position_embeddings", 2048)
    original = _positive_int(
        _default(
            config,
            "original_max_position_embeddings",
            _default(params, "original_max_position_embeddings", max_len),
        ),
        "original_max_position_embeddings",
    )
    factor = params.get("factor")
    factor = max_len / original if factor is None else _number(factor, "factor")
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    attention = _number(attention, "attention_factor")
    if not attention > 0:
        raise LoadError(f"RoPE scaling `attention_factor` must be positive, got {attention!r}")
    return RopeScaling(
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=attention,
        **factors,
    )


def _phi3_config(config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's config as transformers' `Phi3Config` reads it: RoPE `default` or `longrope`
    (which older configs call `su` or `yarn`), `original_max_position_embeddings` 4096 where
    the config leaves it out, and `partial_rotary_factor` from the RoPE settings or else the top
    level. Phi-3 has no biases; a config that asks for them is refused."""
    for name in ("attention_bias", "mlp_bias", "lm_head_bias"):
        if _bool(config, name):
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
    partial = params.get("partial_rotary_factor", _default(config, "partial_rotary_factor", 1.0))
    return {
        "original_max_position_embeddings": 4096,
        **config,
        key: {**params, "rope_type": rope_type},
        "partial_rotary_factor": _number(partial, "partial_rotary_factor"),
    }
