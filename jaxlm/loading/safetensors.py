"""Hugging Face model directories: `config.json`, safetensors weights, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxlm.errors import LoadError
from jaxlm.tokenizer import Tokenizer


def _read_json(path: Path) -> dict:
    """A JSON file holding an object."""
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: should hold a JSON object, not {type(data).__name__}")
    return data


class HFCheckpoint:
    """A Hugging Face model directory, read tensor by tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path}: no `config.json` in this model directory")
        self.config = _read_json(config_file)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = _read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise LoadError(f"{index_file}: no `weight_map` of tensor names to file names")
            self._files = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / "model.safetensors").is_file():
            file = self.path / "model.safetensors"
            self._files = {name: file for name in self._handle(file).keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"{self.path}: no `model.safetensors` or `model.safetensors.index.json`"
            )
        eos, eos_file = self.config.get("eos_token_id"), config_file
        generation_file = self.path / "generation_config.json"
        if generation_file.is_file():
            generation = _read_json(generation_file)
            if "eos_token_id" in generation:
                eos, eos_file = generation["eos_token_id"], generation_file
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise LoadError(f"{eos_file}: `eos_token_id` must be a token id or a list of them")
        self.tokenizer = Tokenizer.from_hf_dir(self.path, eos_token_ids=eos)

    def _handle(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: weights file named in the index is missing")
            try:
                # NumPy arrays (bfloat16 from `ml_dtypes`, which JAX imports) go to the
                # loader's jitted cast as they are; the `flax` frontend's `jnp.array` compiled
                # an identity for each tensor shape, which JAX kept for the life of the process.
                handle = self._handles[file] = safe_open(str(file), framework="numpy")
            except SafetensorError as e:
                raise LoadError(f"{file}: not a valid safetensors file ({e})") from None
        return handle

    def names(self) -> list[str]:
        return list(self._files)

    def file(self, name: str) -> Path:
        """The file that holds tensor `name`."""
        return self._files[name]

    def file_name(self, name: str) -> str:
        """The name of tensor `name` in its file: the same."""
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._files[name]).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        file = self._files[name]
        try:
            return self._handle(file).get_tensor(name)
        except SafetensorError as e:
            raise LoadError(f"{file}: cannot read tensor `{name}` ({e})") from None

    def encoded(self, name: str) -> tuple[np.ndarray, None]:
        """Tensor `name` as stored, which needs no decoding (see `GGUFCheckpoint.encoded`)."""
        return self.read(name), None

    def slicer(self, name: str):
        """A function from an index (a tuple of slices) to that piece of tensor `name`, read
        from the file without reading the rest.
        """
        file = self._files[name]
        tensor = self._handle(file).get_slice(name)

        def read(index):
            try:
                return tensor[index]
            except SafetensorError as e:
                raise LoadError(f"{file}: cannot read tensor `{name}` ({e})") from None

        return read
