"""Model configuration: a frozen dataclass whose fields are Hugging Face `config.json` keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxlm.config_fields import (
    LAYER_TYPES,
    RopeScaling,
    flag,
    gemma3_rope,
    int_div,
    moe_settings,
    number,
    optional_number,
    phi3_config,
    positive_int,
    rope_settings,
    token_id,
    value_or,
)
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
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
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
            positive_int(getattr(self, name), name)
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
            positive_int(self.sliding_window, "sliding_window")
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
            token_id(self.bos_token_id, "bos_token_id")
        for token in self.eos_token_id:
            token_id(token, "eos_token_id")

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
        heads = positive_int(config["num_attention_heads"], "num_attention_heads")
        head_dim = config.get("head_dim") or int_div(
            positive_int(config["hidden_size"], "hidden_size"), heads, "hidden_size"
        )
        local_theta = None
        if gemma3:
            config, local_theta = gemma3_rope(config)
        phi3 = model_type == "phi3"
        if phi3:
            config = phi3_config(config)
        rope_theta, scaling = rope_settings(config)
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
            layers = positive_int(config["num_hidden_layers"], "num_hidden_layers")
            pattern = 2
            if gemma3:
                pattern = positive_int(
                    value_or(config, "sliding_window_pattern", 6), "sliding_window_pattern"
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
            rms_norm_eps=number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=value_or(config, "max_position_embeddings", 2048),
            tie_word_embeddings=flag(config, "tie_word_embeddings"),
            attention_bias=model_type == "qwen2" or flag(config, "attention_bias"),
            mlp_bias=flag(config, "mlp_bias"),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            sliding_window=sliding_window,
            layer_types=None if layer_types is None else tuple(layer_types),
            query_pre_attn_scalar=optional_number(config, "query_pre_attn_scalar", gemma),
            # transformers' Gemma 3 leaves `attn_logit_softcapping` out of its attention.
            attn_logit_softcapping=optional_number(
                config, "attn_logit_softcapping", model_type == "gemma2"
            ),
            final_logit_softcapping=optional_number(config, "final_logit_softcapping", gemma),
            rope_local_base_freq=local_theta,
            partial_rotary_factor=config["partial_rotary_factor"] if phi3 else 1.0,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos,
            **moe_settings(config, model_type),
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
