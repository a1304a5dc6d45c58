"""GGUF tensors: their Hugging Face names and shapes, and dequantising them with numpy or jax."""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from jaxlm.errors import LoadError

# Hugging Face's name for each GGUF tensor name; `{i}` stands for the layer index.
_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# Where an architecture's names differ: OLMo 2 and Gemma norm the attention's output
# (`post_attention_norm`), and Gemma's `ffn_norm` is the norm before its MLP.
_ARCH_TENSOR_NAMES = {
    "olmo2": {
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
    "gemma2": {
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
}
_ARCH_TENSOR_NAMES["gemma3"] = _ARCH_TENSOR_NAMES["gemma2"]
# Phi-3 keeps its checkpoints' fused projections, gate and up in `ffn_up`.
_ARCH_TENSOR_NAMES["phi3"] = {
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
}
# A mixture of experts' router and experts: llama.cpp stacks a layer's experts in one tensor,
# `[experts, rows, columns]`, which reads as the Hub's tensor per expert (`{e}` its index, see
# `_expert_tensors`). llama.cpp writes Mixtral as `llama`, named as Mixtral's checkpoints.
_ARCH_TENSOR_NAMES["llama"] = {
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w1.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w3.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w2.weight",
}
_ARCH_TENSOR_NAMES["qwen3moe"] = {
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{{e}}.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{{e}}.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{{e}}.down_proj.weight",
}
# llama.cpp's converter stores Gemma's norm weights plus one (q and k norms too), which Hugging
# Face adds as it computes (`x * (1 + weight)`); jaxlm subtracts it back as it reads them.
_NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
_ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's frequency factors for short and for long sequences (Phi-3), read into the config.
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter applies to Q and K projections.

    `convert_hf_to_gguf.py` reorders the rows of each head from Hugging Face's "rotate half"
    rope layout to the interleaved one (`LlamaModel.permute`); this is its exact inverse. `w` is a
    weight `[n_heads * head_dim, in]` or a bias `[n_heads * head_dim]`; pass the number of KV
    heads for K.
    """
    rows = w.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of an even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Bytes per block of 32 values of the block formats `Dequantizer` decodes.
_BLOCK_BYTES = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q8_0: 34,
}
_DEVICE_FORMATS = {*_BLOCK_BYTES, GGMLQuantizationType.F32, GGMLQuantizationType.F16}


@dataclasses.dataclass(frozen=True)
class Dequantizer:
    """Decodes one GGUF tensor's stored bytes to float32 in Hugging Face layout, with jax ops.

    Traced inside the jitted function that casts and places a tensor, it replaces `gguf.quants`'
    numpy code, slower than XLA even with the transposes counted, and gives the same values bit
    for bit (see `docs/performance.md`, "GGUF dequantisation"). `heads` undoes llama.cpp's
    Q/K row permutation, and `shift` is added to the values (see `_NORM_PLUS_ONE`). Equal
    dequantizers compare equal, so tensors of one kind and shape share an executable.
    """

    kind: GGMLQuantizationType
    shape: tuple[int, ...]
    heads: int | None = None
    shift: float = 0.0

    def __call__(self, raw: jax.Array) -> jax.Array:
        if self.kind in _BLOCK_BYTES:
            x = self._blocks(raw.reshape(-1, _BLOCK_BYTES[self.kind]))
        else:
            x = raw.astype(jnp.float32)
        x = x.reshape(self.shape)
        if self.shift:
            x = x + self.shift
        return x if self.heads is None else unpermute_qk(x, self.heads)

    def finite(self, raw: jax.Array, dtype) -> jax.Array | None:
        """Whether decoding `raw` and casting it to `dtype` gives finite values, read from the
        blocks' scales alone; None where only the decoded values can tell.

        A quantised value is a small integer times a float16 scale, plus a float16 offset in
        Q4_1: below 1e7 in magnitude, so finite in float32 and bfloat16 exactly when
        the scales are. XLA:CPU's reductions are slow, and checking every decoded weight takes a
        large share of a load (see `docs/performance.md`, "GGUF finite check").
        """
        if self.kind not in _BLOCK_BYTES or jnp.dtype(dtype) == jnp.float16:
            return None
        blocks = raw.reshape(-1, _BLOCK_BYTES[self.kind])
        scales = [blocks[:, 0:2]]
        if self.kind == GGMLQuantizationType.Q4_1:
            scales.append(blocks[:, 2:4])
        pairs = jnp.concatenate(scales, axis=1).reshape(-1, 2)
        return jnp.isfinite(jax.lax.bitcast_convert_type(pairs, jnp.float16)).all()

    def _blocks(self, blocks: jax.Array) -> jax.Array:
        # Each block starts with float16 scale `d`; Q4_1 adds a float16 offset `m`. Four-bit
        # blocks keep values 0-15 in the low nibbles of their 16 bytes and 16-31 in the high.
        def f16(pair):
            return jax.lax.bitcast_convert_type(pair, jnp.float16).astype(jnp.float32)

        d = f16(blocks[:, 0:2])[:, None]
        if self.kind == GGMLQuantizationType.Q8_0:
            return d * jax.lax.bitcast_convert_type(blocks[:, 2:], jnp.int8).astype(jnp.float32)
        nibbles = blocks[:, 4:] if self.kind == GGMLQuantizationType.Q4_1 else blocks[:, 2:]
        q = jnp.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(jnp.float32)
        if self.kind == GGMLQuantizationType.Q4_1:
            return d * q + f16(blocks[:, 2:4])[:, None]
        return d * (q - 8)


def _hf_shape(tensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first, the reverse of numpy's order.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantize(tensor, path: pathlib.Path) -> np.ndarray:
    kind = tensor.tensor_type
    try:
        if kind == GGMLQuantizationType.F32:
            return np.array(tensor.data, dtype=np.float32)
        if kind == GGMLQuantizationType.F64:
            return np.asarray(tensor.data, dtype=np.float64).astype(np.float32)
        return np.asarray(gguf.quants.dequantize(tensor.data, kind), dtype=np.float32)
    except NotImplementedError:
        raise LoadError(
            f"{path}: tensor `{tensor.name}` has type `{kind.name}`, which jaxlm cannot dequantise"
        ) from None
    except (ValueError, TypeError) as e:
        raise LoadError(f"{path}: tensor `{tensor.name}` ({kind.name}) is corrupt ({e})") from None


_dequantizable: dict[GGMLQuantizationType, bool] = {}


def _can_dequantize(kind: GGMLQuantizationType) -> bool:
    """Whether `gguf.quants` dequantises `kind`, found by dequantising one block of zeros."""
    if kind not in _dequantizable:
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F64):
            ok = True
        else:
            block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
            try:
                gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), kind)
                ok = True
            except NotImplementedError:
                ok = False
        _dequantizable[kind] = ok
    return _dequantizable[kind]


def _tensor_names(arch: str) -> dict[str, str]:
    """Hugging Face's name for each GGUF tensor name of `arch`."""
    changes = _ARCH_TENSOR_NAMES.get(arch, {})
    renamed = set(changes.values())
    return {g: h for g, h in _TENSOR_NAMES.items() if h not in renamed} | changes


def _hf_name(gguf_name: str, arch: str) -> str | None:
    names = _tensor_names(arch)
    if gguf_name in names:
        return names[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    pattern = names.get("blk.{i}." + match[2])
    return None if pattern is None else pattern.format(i=int(match[1]))


@dataclasses.dataclass(frozen=True)
class _Expert:
    """One expert of a GGUF tensor of stacked experts, read as a tensor of its own: experts
    are the outermost dimension, so each one's rows, quantised blocks included, lie together."""

    tensor: Any
    expert: int

    @property
    def name(self) -> str:
        return f"{self.tensor.name}[{self.expert}]"

    @property
    def tensor_type(self) -> GGMLQuantizationType:
        return self.tensor.tensor_type

    @property
    def shape(self) -> np.ndarray:
        return self.tensor.shape[:-1]

    @property
    def data(self) -> np.ndarray:
        return self.tensor.data[self.expert]


def _expert_tensors(hf_name: str, tensor) -> dict:
    """`{hf_name: tensor}`, or for a tensor of stacked experts (`hf_name` with `{e}`), each
    expert under its own name."""
    if "{e}" not in hf_name:
        return {hf_name: tensor}
    return {hf_name.format(e=e): _Expert(tensor, e) for e in range(int(tensor.shape[-1]))}


def _expert_shapes(i: int, arch: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The shapes of layer `i`'s router and of each of its experts' tensors."""
    hidden, experts = config["hidden_size"], config["num_local_experts"]
    inter = config.get("moe_intermediate_size", config["intermediate_size"])
    shapes = {
        "gate_inp": (experts, hidden),
        "gate_exps": (inter, hidden),
        "up_exps": (inter, hidden),
        "down_exps": (hidden, inter),
    }
    names = _tensor_names(arch)
    return {
        names[f"blk.{{i}}.ffn_{kind}.weight"].format(i=i).format(e=e): shape
        for kind, shape in shapes.items()
        for e in range(experts)
    }


def _layer_norms(model_type: str) -> tuple[str, ...]:
    """The names of the norms of a layer of `model_type`, each `[hidden]`."""
    if model_type == "olmo2":
        return ("post_attention_layernorm", "post_feedforward_layernorm")
    if model_type in ("gemma2", "gemma3_text"):
        return (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
    return ("input_layernorm", "post_attention_layernorm")


def _check_tensors(path: pathlib.Path, arch: str, config: dict, tensors: dict) -> None:
    """Check that the file has exactly the tensors the config implies, in the right shapes."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    vocab, head_dim = config["vocab_size"], config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    expected = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (vocab, hidden)
    model_type = config["model_type"]
    layers = {int(m[1]) for m in map(_HF_LAYER_NAME.match, tensors) if m}
    n = config["num_hidden_layers"]
    # Distinct indices from 0, as many as the layers: exactly `range(n)`, without building it.
    if len(layers) != n or max(layers, default=-1) != n - 1:
        raise LoadError(
            f"{path}: metadata `{model_type}.block_count` is {config['num_hidden_layers']}, but "
            f"the file has tensors for {len(layers)} layers"
        )
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected |= {p + f"{norm}.weight": (hidden,) for norm in _layer_norms(model_type)}
        if model_type == "phi3":
            expected |= {
                p + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
                p + "mlp.gate_up_proj.weight": (2 * inter, hidden),
            }
        else:
            expected |= {
                p + "self_attn.q_proj.weight": (q_rows, hidden),
                p + "self_attn.k_proj.weight": (kv_rows, hidden),
                p + "self_attn.v_proj.weight": (kv_rows, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
            }
        expected |= {
            p + "self_attn.o_proj.weight": (hidden, q_rows),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.get("num_local_experts"):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del expected[p + f"mlp.{proj}.weight"]
            expected |= _expert_shapes(i, arch, config)
        if model_type in ("qwen3", "gemma3_text", "qwen3_moe"):
            expected[p + "self_attn.q_norm.weight"] = (head_dim,)
            expected[p + "self_attn.k_norm.weight"] = (head_dim,)
        if model_type == "olmo2":
            expected[p + "self_attn.q_norm.weight"] = (q_rows,)
            expected[p + "self_attn.k_norm.weight"] = (kv_rows,)
        if config["attention_bias"] or model_type == "qwen2":
            expected[p + "self_attn.q_proj.bias"] = (q_rows,)
            expected[p + "self_attn.k_proj.bias"] = (kv_rows,)
            expected[p + "self_attn.v_proj.bias"] = (kv_rows,)
            # Qwen2 has biases on Q, K and V only; Hugging Face's `attention_bias` means all four.
            if model_type != "qwen2":
                expected[p + "self_attn.o_proj.bias"] = (hidden,)

    unexpected = [t.name for n, t in tensors.items() if n not in expected]
    if unexpected:
        raise LoadError(
            f"{path}: unexpected tensors for this `{model_type}` model: "
            + ", ".join(f"`{n}`" for n in unexpected[:5])
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise LoadError(
            f"{path}: missing tensors "
            + ", ".join(f"`{_gguf_name(n, arch)}`" for n in missing[:5])
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    for name, tensor in tensors.items():
        if _hf_shape(tensor) != expected[name]:
            raise LoadError(
                f"{path}: tensor `{tensor.name}` has shape {list(tensor.shape.tolist())} (GGUF "
                f"order), but the metadata implies {list(reversed(expected[name]))}"
            )


def _gguf_name(hf_name: str, arch: str) -> str:
    """The GGUF name of a Hugging Face tensor name, for error messages."""
    for gguf_pattern, hf_pattern in _tensor_names(arch).items():
        regex = re.escape(hf_pattern).replace(r"\{i\}", r"(\d+)").replace(r"\{\{e\}\}", r"\d+")
        match = re.fullmatch(regex, hf_name)
        if match:
            return gguf_pattern.format(i=match[1]) if match.groups() else gguf_pattern
    return hf_name
