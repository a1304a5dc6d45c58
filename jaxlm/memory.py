"""The static memory plan: declared scratch, its layout, and the whole bill before allocation.

Modules declare the scratch they need in `__init__` as `ScratchSpec`s: shapes that may name the
plan dimensions (`"batch"`, `"seq"`, `"num_pages"`, `"page_size"`), a dtype, and logical
sharding axes. A spec is a static
attribute of the module, so it allocates nothing and an abstract model (`nnx.eval_shape`)
declares exactly the same scratch. `jaxlm.plan` collects the specs, binds the dimensions, lays
the slots out, compiles the step functions and reads XLA's memory analysis, so the whole bill
(weights + scratch + XLA temporaries) is known before any scratch exists.

Layout: one array per slot. An arena or stacked arrays updated in place no faster, and stacking
pays only under `scan`, which runs slower over stacked weights on XLA:CPU (see
`docs/performance.md`, "Scratch layout: one array per slot"). Separate arrays also shard
independently (per-slot `axes`) and show up one by one in the plan.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxlm.errors import PlanError

PLAN_DIMS = ("batch", "seq", "num_pages", "page_size")
# XLA:CPU aligns every buffer to 64 bytes; each slot is its own buffer, so offsets are all 0.
ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class ScratchSpec:
    """An abstract declaration of scratch state: nothing is allocated.

    `shape` entries are ints, plan dimension names (`"batch"`, `"seq"`) or tuples of those,
    whose product is the dimension (`("batch", 3)` is three rows per batch row); `axes` names
    the logical sharding axis of each dimension (`None`, a name such as `"batch"`, or a tuple
    of names for a product dimension; see `jaxlm.sharding`); `persistent` slots carry state
    across calls (caches, positions), the others only within one call.
    """

    shape: tuple[int | str | tuple[int | str, ...], ...]
    dtype: Any
    axes: tuple[str | None, ...] = ()
    persistent: bool = True
    doc: str = ""

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(self.shape))
        axes = tuple(self.axes) or (None,) * len(self.shape)
        if len(axes) != len(self.shape):
            raise ValueError(f"`axes` {axes} do not match `shape` {self.shape}")
        object.__setattr__(self, "axes", axes)
        for entry in self.shape:
            for d in entry if isinstance(entry, tuple) else (entry,):
                if isinstance(d, str) and d not in PLAN_DIMS:
                    raise ValueError(f"unknown plan dimension {d!r}; use one of {PLAN_DIMS}")

    def replace(self, **changes) -> ScratchSpec:
        return dataclasses.replace(self, **changes)

    def bind(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        def size(d):
            return dims[d] if isinstance(d, str) else d

        return tuple(
            math.prod(size(d) for d in e) if isinstance(e, tuple) else size(e) for e in self.shape
        )


@dataclasses.dataclass(frozen=True)
class Slot:
    """A declared scratch slot bound to a plan: where it lives and what it costs."""

    path: tuple[str | int, ...]
    spec: ScratchSpec
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: NamedSharding | None = None

    @property
    def owner(self) -> str:
        return ".".join(str(p) for p in self.path[:-1])

    @property
    def name(self) -> str:
        return str(self.path[-1])

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of the piece each device holds."""
        return self.sharding.shard_shape(self.shape) if self.sharding else self.shape

    @property
    def device_nbytes(self) -> int:
        """Bytes each device holds (all of the slot on a single device)."""
        return int(np.prod(self.shard_shape, dtype=np.int64)) * self.dtype.itemsize


def declarations(module: nnx.Module, prefix: tuple = ()) -> Iterator[tuple[tuple, ScratchSpec]]:
    """Every `ScratchSpec` declared in the module tree, with its path in the scratch tree."""
    for path, sub in nnx.iter_modules(module):
        for name, value in sorted(vars(sub).items()):
            if isinstance(value, ScratchSpec):
                yield (*prefix, *path, name), value


def set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


@dataclasses.dataclass(frozen=True)
class Layout:
    """The declared slots bound to plan dimensions, one array each."""

    slots: tuple[Slot, ...]
    dims: Mapping[str, int]

    @classmethod
    def build(cls, decls, dims: Mapping[str, int], storage, partitioner=None) -> Layout:
        """Bind `decls` to `dims`, each slot stored in `storage(dtype)` (`jaxlm.ops.storage_dtype`);
        with a `jaxlm.sharding.Partitioner`, split them on its mesh."""
        slots = tuple(
            Slot(
                path,
                spec,
                spec.bind(dims),
                storage(spec.dtype),
                partitioner.sharding(spec.axes) if partitioner else None,
            )
            for path, spec in decls
        )
        return cls(slots, dict(dims))

    @property
    def device_nbytes(self) -> int:
        """Bytes of scratch each device holds (all of it on a single device)."""
        return sum(s.device_nbytes for s in self.slots)

    def tree(self, leaf) -> dict:
        tree: dict = {}
        for slot in self.slots:
            set_path(tree, slot.path, leaf(slot))
        return tree

    def abstract(self) -> dict:
        """The scratch tree as `jax.ShapeDtypeStruct`s (allocates nothing)."""
        return self.tree(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding))

    def allocate(self) -> dict:
        """The scratch tree, zero-filled: the only allocation of scratch a plan makes."""
        return self._zeros()

    @functools.cached_property
    def _zeros(self):
        # One executable fills every slot (`jnp.zeros` slot by slot compiled two per shape),
        # traced once per layout rather than at every `allocate`.
        sharded = any(s.sharding is not None for s in self.slots)
        shardings = {"out_shardings": self.tree(lambda s: s.sharding)} if sharded else {}
        return jax.jit(lambda: self.tree(lambda s: jnp.zeros(s.shape, s.dtype)), **shardings)

    def check(self, scratch) -> None:
        """Raise if `scratch` is not a live scratch tree of this layout."""
        expected = self.abstract()
        got_def = jax.tree.structure(scratch)
        if got_def != jax.tree.structure(expected):
            raise PlanError("`scratch` does not belong to this plan (its slots differ)")
        for slot, want, have in zip(
            self.slots, jax.tree.leaves(expected), jax.tree.leaves(scratch), strict=True
        ):
            if tuple(have.shape) != want.shape or have.dtype != want.dtype:
                raise PlanError(
                    f"`scratch` does not belong to this plan: slot `{slot.owner}.{slot.name}` "
                    f"is {have.dtype}{list(have.shape)}, "
                    f"the plan has {want.dtype}{list(want.shape)}"
                )
            if isinstance(have, jax.Array) and have.is_deleted():
                raise PlanError(
                    f"`scratch` slot `{slot.owner}.{slot.name}` was donated to an earlier step; "
                    "use the scratch that step returned"
                )


@dataclasses.dataclass(frozen=True)
class ExecutableMemory:
    """XLA's memory analysis of one compiled step, in bytes."""

    name: str
    argument: int
    output: int
    alias: int
    temp: int

    @classmethod
    def of(cls, name: str, compiled) -> ExecutableMemory:
        m = compiled.memory_analysis()
        return cls(
            name,
            int(m.argument_size_in_bytes),
            int(m.output_size_in_bytes),
            int(m.alias_size_in_bytes),
            int(m.temp_size_in_bytes),
        )

    @property
    def peak(self) -> int:
        # XLA:CPU's `peak_memory_in_bytes` leaves out temporaries (research Q2), so the peak of
        # an executable is computed from its parts.
        return self.argument + self.output - self.alias + self.temp


_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNITS.update({"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12})
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


@functools.cache
def _malloc_trim():
    # glibc's `malloc_trim`, or None under another C library.
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def process_status(field: str) -> int | None:
    """A size from `/proc/self/status` (`VmRSS`, `VmHWM`, ...) in bytes, or None where there is
    no such file (outside Linux) or field.
    """
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def resident_bytes(settled: bool = False) -> int | None:
    """The resident set size of this process now (`VmRSS`), in bytes; None outside Linux.
    `settled`: once unreachable objects are collected and the C heap's free pages handed back
    (`release_host_memory`), so that only live memory counts."""
    if settled:
        gc.collect()
        release_host_memory()
    return process_status("VmRSS")


def release_host_memory() -> bool:
    """Hand the C heap's free pages back to the operating system; whether it could.

    Loading and compiling free much memory in small blocks, which glibc keeps mapped for reuse
    (see `docs/performance.md`, "Host memory"); `malloc_trim` returns every free page. Under C
    libraries without it, this does nothing and returns False.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def parse_bytes(size: int | float | str) -> int:
    """Bytes from an int or a string such as `"1.5GiB"`, `"800MB"` or `"2e9"`."""
    if isinstance(size, bool):
        raise ValueError(f"`budget` must be a number of bytes or a size string, got {size!r}")
    if isinstance(size, int | float):
        value = float(size)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(size))
        unit = match and _UNITS.get(match.group(2).lower())
        if not match or unit is None:
            raise ValueError(
                f"`budget` {size!r} is not a size; write bytes or e.g. '1.5GiB', '800MB'"
            )
        try:
            value = float(match.group(1)) * unit
        except ValueError:
            raise ValueError(f"`budget` {size!r} is not a size") from None
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"`budget` must be positive, got {size!r}")
    return int(value)


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
