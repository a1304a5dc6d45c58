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

import pathlib
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from jaxlm.errors import LoadError
from jaxlm.loading.gguf.config import _ARCHITECTURES, _PERMUTED_QK, _config
from jaxlm.loading.gguf.reader import _Metadata, _open_reader
from jaxlm.loading.gguf.reader import _Reader as _Reader
from jaxlm.loading.gguf.tensors import (
    _DEVICE_FORMATS,
    _NORM_PLUS_ONE,
    _ROPE_FACTORS,
    _ROPE_FREQS,
    Dequantizer,
    _can_dequantize,
    _check_tensors,
    _dequantize,
    _expert_tensors,
    _hf_name,
    _hf_shape,
    unpermute_qk,
)
from jaxlm.loading.gguf.tokenizer import _tokenizer
from jaxlm.tokenizer import Tokenizer

__all__ = ["Dequantizer", "GGUFCheckpoint", "open_gguf", "unpermute_qk"]


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
        shifts: dict[str, float],
    ):
        self.path = path
        self.config = config
        self.tokenizer = tokenizer
        self._reader = reader
        self._tensors = tensors
        self._permuted_heads = permuted_heads
        self._shifts = shifts

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
        if name in self._shifts:
            array = array + np.float32(self._shifts[name])
        return np.ascontiguousarray(array, dtype=np.float32)

    def encoded(self, name: str) -> tuple[np.ndarray, Dequantizer | None]:
        """Tensor `name` as stored and the `Dequantizer` that decodes it inside a jitted
        function, or, for formats without one, the tensor `read` gives and `None`.
        """
        tensor = self._tensor(name)
        if tensor.tensor_type not in _DEVICE_FORMATS:
            return self.read(name), None
        heads = self._permuted_heads.get(name)
        shift = self._shifts.get(name, 0.0)
        return tensor.data, Dequantizer(tensor.tensor_type, _hf_shape(tensor), heads, shift)

    def slicer(self, name: str):
        """A function from an index to that piece of tensor `name` (dequantised once)."""
        array = self.read(name)
        return lambda index: array[index]


def open_gguf(path: str | pathlib.Path) -> GGUFCheckpoint:
    """Open a llama.cpp GGUF model file (Llama, Mixtral as `llama` with experts, Qwen2,
    Qwen3, Qwen3-MoE, OLMo 2, Gemma 2, Gemma 3 or Phi-3 architecture).

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
        if name == _ROPE_FREQS or name in _ROPE_FACTORS:
            continue
        hf_name = _hf_name(name, arch)
        if hf_name is None:
            raise LoadError(f"{path}: unknown tensor `{name}` for architecture `{arch}`")
        tensors |= _expert_tensors(hf_name, tensor)
    _check_tensors(path, arch, config, tensors)

    permuted = {}
    if arch in _PERMUTED_QK:
        for i in range(config["num_hidden_layers"]):
            for proj, heads in (
                ("q_proj", config["num_attention_heads"]),
                ("k_proj", config["num_key_value_heads"]),
            ):
                for kind in ("weight", "bias"):
                    permuted[f"model.layers.{i}.self_attn.{proj}.{kind}"] = heads

    shifts = {}
    if arch in _NORM_PLUS_ONE:
        shifts = {name: -1.0 for name in tensors if name.endswith("norm.weight")}

    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        tokenizer = _tokenizer(meta, tokens, config["vocab_size"])
    return GGUFCheckpoint(path, reader, config, tokenizer, tensors, permuted, shifts)
