"""Reading llama.cpp GGUF files: a Hugging Face style config, the tokenizer and dequantised tensors.

`open_gguf` parses the metadata and the tensor table; tensor data stays memory-mapped until
`GGUFCheckpoint.read` dequantises one tensor to float32, in Hugging Face layout and naming.
`GGUFCheckpoint.encoded` hands `jaxlm.load` a tensor's raw blocks and a `Dequantizer` that
unpacks them inside XLA instead (Q4_0, Q4_1, Q8_0, F16, F32).

Example:
    >>> ckpt = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> ckpt.config["num_hidden_layers"]
    30
    >>> ckpt.read("model.layers.0.self_attn.q_proj.weight").shape
    (576, 576)
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import struct
from collections.abc import Sequence
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from gguf import GGMLQuantizationType, GGUFValueType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from jaxlm.errors import LoadError
from jaxlm.tokenizer import Tokenizer, check_chat_template

__all__ = ["Dequantizer", "GGUFCheckpoint", "open_gguf", "unpermute_qk"]

# Hugging Face's `model_type` for each `general.architecture` jaxlm reads.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter permutes the Q and K rows of these architectures only.
_PERMUTED_QK = frozenset({"llama"})

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
_ROPE_FREQS = "rope_freqs.weight"
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")

# Token types, numbered as in `gguf.TokenType`.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes of llama.cpp (`llm_tokenizer_bpe` in `src/llama-vocab.cpp`), applied one
# after another, each splitting the pieces the previous one left.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp rewrites these two with lookaheads its own regex engine can run, which take capitals
# outside ASCII for lower case; these are the originals from the models' `tokenizer.json`.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORDS_SPLIT = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


class _Pre:
    """A pre-tokenizer of llama.cpp: its regexes and the flags it sets with them."""

    def __init__(self, splits: Sequence[str], ignore_merges: bool = False, add_bos: bool = False):
        self.splits = tuple(splits)
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos


_DEFAULT_PRE = _Pre([r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"])
_LLAMA3_PRE = _Pre([_LLAMA3_SPLIT], ignore_merges=True, add_bos=True)
_PRE_TOKENIZERS = {
    "default": _DEFAULT_PRE,
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _Pre([_LLAMA3_SPLIT])),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
        _Pre([r"\p{N}", _GPT2_SPLIT]),
    ),
    **dict.fromkeys(
        [
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
        ],
        _Pre([_GPT2_SPLIT]),
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan"],
        _Pre([_QWEN2_SPLIT]),
    ),
    "falcon": _Pre([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"]),
    "deepseek-coder": _Pre(
        [
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            r"\p{N}",
        ]
    ),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _Pre([_WORDS_SPLIT])),
    "viking": _Pre([_WORDS_SPLIT, r"\p{N}"]),
    **dict.fromkeys(["glm4", "chatglm-bpe"], _Pre([_LLAMA3_SPLIT])),
    "tekken": _Pre([_TEKKEN_SPLIT], ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _Pre([_GPT4O_SPLIT])),
}

# The rope frequency factors of Llama 3.1 and 3.2 that `rope_freqs.weight` can hold, as
# (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
_LLAMA3_ROPE_CANDIDATES = ((1.0, 4.0, 8192),)

_INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_MISSING = object()


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


def _float(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


class _Metadata:
    """Typed access to a GGUF file's key-value metadata, raising `LoadError` on a bad value."""

    def __init__(self, reader: gguf.GGUFReader, path: pathlib.Path):
        self.fields = reader.fields
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def _fail(self, key: str, what: str) -> LoadError:
        return LoadError(f"{self.path}: metadata `{key}` {what}")

    def _field(self, key: str, default: Any):
        field = self.fields.get(key)
        if field is None and default is _MISSING:
            raise self._fail(key, "is missing")
        return field

    def int_value(self, key: str, default: Any = _MISSING) -> Any:
        """An integer; a per-layer array is accepted when all its entries are equal."""
        field = self._field(key, default)
        if field is None:
            return default
        kinds = field.types
        if kinds and kinds[0] == GGUFValueType.ARRAY and kinds[-1] in _INT_TYPES:
            values = set(field.contents())
            if len(values) != 1:
                raise self._fail(key, f"differs between layers ({sorted(values)}), unsupported")
            return int(values.pop())
        if len(kinds) != 1 or kinds[0] not in _INT_TYPES:
            raise self._fail(key, f"should be an integer, not {_type_name(kinds)}")
        return int(field.contents())

    def float_value(self, key: str, default: Any = _MISSING) -> Any:
        field = self._field(key, default)
        if field is None:
            return default
        if len(field.types) != 1 or field.types[0] not in _FLOAT_TYPES | _INT_TYPES:
            raise self._fail(key, f"should be a number, not {_type_name(field.types)}")
        return _float(field.contents())

    def bool_value(self, key: str, default: Any = _MISSING) -> Any:
        field = self._field(key, default)
        if field is None:
            return default
        if field.types != [GGUFValueType.BOOL]:
            raise self._fail(key, f"should be a bool, not {_type_name(field.types)}")
        return bool(field.contents())

    def str_value(self, key: str, default: Any = _MISSING) -> Any:
        field = self._field(key, default)
        if field is None:
            return default
        if field.types != [GGUFValueType.STRING]:
            raise self._fail(key, f"should be a string, not {_type_name(field.types)}")
        try:
            return field.contents()
        except UnicodeDecodeError as e:
            raise self._fail(key, f"is not valid UTF-8 ({e})") from None

    def array_value(self, key: str, element_types: frozenset, default: Any = _MISSING) -> Any:
        field = self._field(key, default)
        if field is None:
            return default
        kinds = field.types
        if not kinds or kinds[0] != GGUFValueType.ARRAY:
            raise self._fail(key, f"should be an array, not {_type_name(kinds)}")
        if len(field.data) == 0:
            return []
        if len(kinds) != 2 or kinds[1] not in element_types:
            raise self._fail(key, f"has elements of the wrong type ({_type_name(kinds)})")
        try:
            return field.contents()
        except UnicodeDecodeError as e:
            raise self._fail(key, f"holds a string that is not valid UTF-8 ({e})") from None


def _type_name(kinds: Sequence[GGUFValueType]) -> str:
    return "[" + ", ".join(k.name for k in kinds) + "]" if len(kinds) > 1 else kinds[0].name


class GGUFCheckpoint:
    """A GGUF model file: its config, tokenizer and tensors under Hugging Face names.

    Attributes:
        path: The file.
        config: The model's configuration as a Hugging Face `config.json` style dict.
        tokenizer: The tokenizer the metadata describes, or `None` if it describes none.
    """

    def __init__(
        self,
        path: pathlib.Path,
        reader: gguf.GGUFReader,
        config: dict,
        tokenizer: Tokenizer | None,
        tensors: dict[str, Any],
        permuted_heads: dict[str, int],
    ):
        self.path = path
        self.config = config
        self.tokenizer = tokenizer
        self._reader = reader
        self._tensors = tensors
        self._permuted_heads = permuted_heads

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, model_type={self.config['model_type']!r})"

    def names(self) -> list[str]:
        """The Hugging Face names of the tensors, in file order."""
        return list(self._tensors)

    def file(self, name: str) -> pathlib.Path:
        """The file that holds tensor `name`: this one."""
        return self.path

    def file_name(self, name: str) -> str:
        """The GGUF name of tensor `name`."""
        return self._tensor(name).name

    def _tensor(self, name: str):
        tensor = self._tensors.get(name)
        if tensor is None:
            raise KeyError(f"{self.path} has no tensor `{name}`")
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` in Hugging Face layout, without reading it."""
        return _hf_shape(self._tensor(name))

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` dequantised to a float32 array in Hugging Face layout."""
        tensor = self._tensor(name)
        array = _dequantize(tensor, self.path).reshape(_hf_shape(tensor))
        heads = self._permuted_heads.get(name)
        if heads is not None:
            array = unpermute_qk(array, heads)
        return np.ascontiguousarray(array, dtype=np.float32)

    def encoded(self, name: str) -> tuple[np.ndarray, Dequantizer | None]:
        """Tensor `name` as stored and the `Dequantizer` that decodes it inside a jitted
        function, or, for formats without one, the tensor `read` gives and `None`.
        """
        tensor = self._tensor(name)
        if tensor.tensor_type not in _DEVICE_FORMATS:
            return self.read(name), None
        heads = self._permuted_heads.get(name)
        return tensor.data, Dequantizer(tensor.tensor_type, _hf_shape(tensor), heads)

    def slicer(self, name: str):
        """A function from an index to that piece of tensor `name` (dequantised once)."""
        array = self.read(name)
        return lambda index: array[index]


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
    numpy code (1 s for SmolLM2's Q4_1 weights, against 0.3 s in XLA, transposes included) and
    gives the same values bit for bit. `heads` undoes llama.cpp's Q/K row permutation. Equal
    dequantizers compare equal, so tensors of one kind and shape share an executable.
    """

    kind: GGMLQuantizationType
    shape: tuple[int, ...]
    heads: int | None = None

    def __call__(self, raw: jax.Array) -> jax.Array:
        if self.kind in _BLOCK_BYTES:
            x = self._blocks(raw.reshape(-1, _BLOCK_BYTES[self.kind]))
        else:
            x = raw.astype(jnp.float32)
        x = x.reshape(self.shape)
        return x if self.heads is None else unpermute_qk(x, self.heads)

    def finite(self, raw: jax.Array, dtype) -> jax.Array | None:
        """Whether decoding `raw` and casting it to `dtype` gives finite values, read from the
        blocks' scales alone; None where only the decoded values can tell.

        A quantised value is a small integer times a float16 scale, plus a float16 offset in
        Q4_1: below 1e7 in magnitude, so finite in float32 and bfloat16 exactly when
        the scales are. XLA:CPU's reductions are slow, and checking all of SmolLM2's decoded
        weights took 0.35 s of its 0.8 s load.
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


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    pattern = _TENSOR_NAMES.get("blk.{i}." + match[2])
    return None if pattern is None else pattern.format(i=int(match[1]))


def _check_header(path: pathlib.Path) -> None:
    """Reject files that are not GGUF, or whose counts could not fit in them, before parsing."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(24)
    if head[:4] != b"GGUF":
        raise LoadError(f"{path}: not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
    if len(head) < 24:
        raise LoadError(f"{path}: truncated GGUF file ({size} bytes, shorter than its header)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise LoadError(f"{path}: unsupported GGUF version {version}")
    # Every tensor entry and key-value pair takes at least 8 bytes.
    if n_tensors > size // 8 or n_kv > size // 8:
        raise LoadError(
            f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata entries "
            f"in a {size}-byte file)"
        )


class _Reader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain array view of its memory map.

    The reader parses every metadata value through a slice of `np.memmap`, and each slice of a
    memmap runs `np.memmap.__array_finalize__`: 3x slower over the 100k strings of a tokenizer
    (2.7 s against 0.9 s for SmolLM2's file). The view reads the same mapped bytes.

    Arrays are parsed in one pass instead of element by element (0.9 s to 0.1 s): an array of
    numbers becomes one part, and an array of strings one part per string, without the length
    parts, which nothing reads. `ReaderField.contents` returns the same values either way.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs, n = orig_offs + 12, int(alen[0])
        kind = GGUFValueType(raw_itype[0])
        # As `gguf` does, an empty array has no element type.
        types = [GGUFValueType.ARRAY, kind] if n else [GGUFValueType.ARRAY]
        nptype = self.gguf_scalar_to_np.get(kind)
        if nptype is not None:
            values = self._get(offs, nptype, n)
            if len(values) < n:
                raise ValueError(f"array of {n} values runs past the end of the file")
            size = 12 + int(values.nbytes)
            return size, [raw_itype, alen, values], [2] if n else [], types
        if kind != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        data, parts = self._data, [raw_itype, alen]
        raw = memoryview(data)
        for _ in range(n):
            length = int.from_bytes(raw[offs : offs + 8], "little")
            offs += 8
            if offs + length > len(data):
                raise ValueError(f"string of {length} bytes runs past the end of the file")
            parts.append(data[offs : offs + length])
            offs += length
        return offs - orig_offs, parts, list(range(2, n + 2)), types


def _open_reader(path: pathlib.Path) -> gguf.GGUFReader:
    _check_header(path)
    try:
        reader = _Reader(path)
    except Exception as e:
        # The reader reports a short or corrupt file as whatever numpy raised while parsing it.
        raise LoadError(
            f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})"
        ) from None
    size = path.stat().st_size
    # llama.cpp requires the tensors' data in table order, each padded to the alignment; any
    # other offset is a corrupt table entry that would read another tensor's bytes.
    expected = 0
    for tensor in reader.tensors:
        offset = tensor.data_offset - reader.data_offset
        if offset != expected:
            raise LoadError(
                f"{path}: corrupt GGUF tensor table (tensor `{tensor.name}` starts at byte "
                f"{offset} of the data section, where llama.cpp's layout puts it at {expected})"
            )
        if tensor.data_offset + tensor.n_bytes > size:
            raise LoadError(
                f"{path}: truncated GGUF file (tensor `{tensor.name}` ends at byte "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {size})"
            )
        expected += -(-int(tensor.n_bytes) // reader.alignment) * reader.alignment
    if reader.tensors and size > reader.data_offset + expected:
        raise LoadError(
            f"{path}: corrupt GGUF tensor table ({size - reader.data_offset - expected} bytes "
            "follow the last tensor's data)"
        )
    return reader


def open_gguf(path: str | pathlib.Path) -> GGUFCheckpoint:
    """Open a llama.cpp GGUF model file (Llama, Qwen2 or Qwen3 architecture).

    Parses the metadata into a Hugging Face style config and a tokenizer, maps the tensor names
    to Hugging Face's and checks every tensor's shape; tensor data is read by
    `GGUFCheckpoint.read`.

    Raises:
        FileNotFoundError: `path` does not exist.
        LoadError: the file is not GGUF, is truncated or corrupt, or holds a model, tensor type
            or tokenizer that jaxlm does not support.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if path.is_dir():
        raise LoadError(f"{path}: is a directory, not a GGUF file")
    reader = _open_reader(path)
    meta = _Metadata(reader, path)

    arch = meta.str_value("general.architecture")
    if arch not in _ARCHITECTURES:
        raise LoadError(
            f"{path}: unsupported architecture `{arch}` (jaxlm reads "
            + ", ".join(f"`{a}`" for a in _ARCHITECTURES)
            + ")"
        )

    gguf_tensors = {t.name: t for t in reader.tensors}
    for tensor in reader.tensors:
        if not _can_dequantize(tensor.tensor_type):
            raise LoadError(
                f"{path}: tensor `{tensor.name}` has type `{tensor.tensor_type.name}`, "
                "which jaxlm cannot dequantise"
            )
    tokens = meta.array_value("tokenizer.ggml.tokens", frozenset({GGUFValueType.STRING}), None)
    config = _config(meta, arch, gguf_tensors, tokens)

    tensors = {}
    for name, tensor in gguf_tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(name)
        if hf_name is None:
            raise LoadError(f"{path}: unknown tensor `{name}` for architecture `{arch}`")
        tensors[hf_name] = tensor
    _check_tensors(path, config, tensors)

    permuted = {}
    if arch in _PERMUTED_QK:
        for i in range(config["num_hidden_layers"]):
            for proj, heads in (
                ("q_proj", config["num_attention_heads"]),
                ("k_proj", config["num_key_value_heads"]),
            ):
                for kind in ("weight", "bias"):
                    permuted[f"model.layers.{i}.self_attn.{proj}.{kind}"] = heads

    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        tokenizer = _tokenizer(meta, tokens, config["vocab_size"])
    return GGUFCheckpoint(path, reader, config, tokenizer, tensors, permuted)


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
    if rope_dim != head_dim:
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
    return config


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict, theta: float, head_dim: int):
    path = meta.path
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


def _check_tensors(path: pathlib.Path, config: dict, tensors: dict) -> None:
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
        expected |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_rows, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_rows),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if model_type == "qwen3":
            expected[p + "self_attn.q_norm.weight"] = (head_dim,)
            expected[p + "self_attn.k_norm.weight"] = (head_dim,)
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
            + ", ".join(f"`{_gguf_name(n)}`" for n in missing[:5])
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    for name, tensor in tensors.items():
        if _hf_shape(tensor) != expected[name]:
            raise LoadError(
                f"{path}: tensor `{tensor.name}` has shape {list(tensor.shape.tolist())} (GGUF "
                f"order), but the metadata implies {list(reversed(expected[name]))}"
            )


def _gguf_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor name, for error messages."""
    for gguf_pattern, hf_pattern in _TENSOR_NAMES.items():
        regex = re.escape(hf_pattern).replace(r"\{i\}", r"(\d+)")
        match = re.fullmatch(regex, hf_name)
        if match:
            return gguf_pattern.format(i=match[1]) if match.groups() else gguf_pattern
    return hf_name


def _tokenizer(meta: _Metadata, tokens: list[str] | None, vocab_size: int) -> Tokenizer:
    path = meta.path
    model = meta.str_value("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise LoadError(
            f"{path}: unsupported tokenizer `{model}` (`tokenizer.ggml.model`); jaxlm reads "
            "`gpt2` (byte-level BPE) and `llama` (SentencePiece BPE)"
        )
    if not tokens:
        raise LoadError(f"{path}: metadata `tokenizer.ggml.tokens` is missing or empty")
    n = len(tokens)
    types = meta.array_value("tokenizer.ggml.token_type", frozenset(_INT_TYPES), None)
    if types is None:
        types = [_NORMAL] * n
    if len(types) != n:
        raise LoadError(
            f"{path}: `tokenizer.ggml.token_type` has {len(types)} entries for {n} tokens"
        )
    # llama.cpp renames empty tokens so that every token has distinct text.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    vocab = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise LoadError(
                f"{path}: `tokenizer.ggml.tokens` has `{token}` twice (ids {vocab[token]}, {i})"
            )
        vocab[token] = i

    def token_id(key: str) -> int | None:
        value = meta.int_value(key, None)
        if value is not None and not 0 <= value < n:
            raise LoadError(f"{path}: `{key}` is {value}, outside the {n} tokens")
        return value

    bos = token_id("tokenizer.ggml.bos_token_id")
    eos = token_id("tokenizer.ggml.eos_token_id")
    unk = token_id("tokenizer.ggml.unknown_token_id")
    eos_ids = []
    for key in ("eos", "eot", "eom"):
        value = token_id(f"tokenizer.ggml.{key}_token_id")
        if value is not None and value not in eos_ids:
            eos_ids.append(value)

    try:
        if model == "gpt2":
            backend, add_bos = _bpe_tokenizer(meta, vocab)
        else:
            backend, add_bos = _spm_tokenizer(meta, vocab, tokens, types, unk)
        add_bos = meta.bool_value("tokenizer.ggml.add_bos_token", add_bos)
        add_eos = meta.bool_value("tokenizer.ggml.add_eos_token", False)
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind in (_CONTROL, _UNKNOWN)
        ]
        user_defined = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED
        ]
        backend.add_special_tokens(specials)
        backend.add_tokens(user_defined)
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"{path}: cannot build the `{model}` tokenizer ({e})") from None

    first = last = []
    if add_bos:
        first = [_special_token(path, tokens, bos, "bos")]
    if add_eos:
        last = [_special_token(path, tokens, eos, "eos")]
    if first or last:
        backend.post_processor = processors.TemplateProcessing(
            single=[*first, "$A", *last],
            pair=[*first, "$A", *last, *first, "$B:1", *last],
            special_tokens=list({vocab[t]: (t, vocab[t]) for t in first + last}.values()),
        )
    if backend.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise LoadError(f"{path}: the tokenizer has more tokens than the model's vocabulary")
    template = meta.str_value("tokenizer.chat_template", None)
    if template is not None:
        check_chat_template(template, path)
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template)


def _special_token(path: pathlib.Path, tokens: list[str], token: int | None, key: str) -> str:
    if token is None:
        raise LoadError(
            f"{path}: `tokenizer.ggml.add_{key}_token` is set but `tokenizer.ggml.{key}_token_id` "
            "is missing"
        )
    return tokens[token]


def _bpe_tokenizer(meta: _Metadata, vocab: dict[str, int]) -> tuple[tokenizers.Tokenizer, bool]:
    """Byte-level BPE (`tokenizer.ggml.model` `gpt2`), and whether llama.cpp adds BOS by default."""
    path = meta.path
    pre_name = meta.str_value("tokenizer.ggml.pre", "default")
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise LoadError(f"{path}: unsupported pre-tokenizer `{pre_name}` (`tokenizer.ggml.pre`)")
    merges = []
    for text in meta.array_value("tokenizer.ggml.merges", frozenset({GGUFValueType.STRING}), []):
        # A merge is "left right"; llama.cpp looks for the space from the second character on.
        cut = text.find(" ", 1)
        if cut < 0:
            raise LoadError(f"{path}: malformed merge `{text}` in `tokenizer.ggml.merges`")
        merges.append((text[:cut], text[cut + 1 :]))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, pre.add_bos


def _spm_tokenizer(
    meta: _Metadata, vocab: dict[str, int], tokens: list[str], types: list[int], unk: int | None
) -> tuple[tokenizers.Tokenizer, bool]:
    """SentencePiece BPE (`tokenizer.ggml.model` `llama`), as llama.cpp runs it.

    llama.cpp merges the adjacent pair whose joined text is the highest-scoring token; BPE merges
    ranked by that score do the same. Characters that end up in no token become `<0xXX>` byte
    tokens.
    """
    n = len(tokens)
    scores = meta.array_value("tokenizer.ggml.scores", _FLOAT_TYPES, None)
    if scores is None:
        scores = [0.0] * n
    if len(scores) != n:
        raise LoadError(
            f"{meta.path}: `tokenizer.ggml.scores` has {len(scores)} entries for {n} tokens"
        )
    candidates = []
    for token, i in vocab.items():
        if types[i] in (_CONTROL, _UNKNOWN, _BYTE):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[i], i, cut, left, right))
    candidates.sort()
    merges = [(left, right) for *_, left, right in candidates]
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=byte_fallback,
        )
    )
    add_space_prefix = meta.bool_value("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend, True
