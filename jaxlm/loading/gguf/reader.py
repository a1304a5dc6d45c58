"""Reading a GGUF file: the header check, the parser and typed access to the metadata."""

from __future__ import annotations

import pathlib
import struct
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from jaxlm.errors import LoadError

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
    memmap runs `np.memmap.__array_finalize__`, which makes parsing the many strings of a
    tokenizer several times slower (see `docs/performance.md`, "GGUF metadata parsing").
    The view reads the same mapped bytes.

    Arrays are parsed in one pass instead of element by element, which is faster again (see
    `docs/performance.md`, "GGUF metadata parsing"). An array of numbers becomes one part,
    and an array of strings one part per string, without the length parts, which nothing reads.
    `ReaderField.contents` returns the same values either way.
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
