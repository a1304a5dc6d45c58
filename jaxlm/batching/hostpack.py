"""The host side of the engine's steps' inputs: arrays made (`zeros`) and packed into one buffer
(`HostPack`) without letting the GIL go."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def zeros(shape, dtype=np.int32) -> np.ndarray:
    """Zeros made without letting the GIL go. NumPy lets it go to zero more than 1 KiB, and its
    copies of more than 500 values; taking it back beside a busy Python thread waits out the
    switch interval each time (`docs/performance.md`, "The engine's thread and the GIL")."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    return np.frombuffer(bytearray(size), dtype).reshape(shape)


class HostPack:
    """A pytree of arrays of fixed shapes as one byte buffer: `pack` it on the host, `unpack` it
    inside the jitted function that takes `spec`."""

    def __init__(self, tree):
        leaves, self._treedef = jax.tree.flatten(tree)
        self._fields, offset = [], 0
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            self._fields.append((offset, leaf.shape, dtype))
            # Each field starts on 4 bytes, so that it bitcasts from an aligned slice.
            offset += -(-math.prod(leaf.shape) * dtype.itemsize // 4) * 4
        self.spec = jax.ShapeDtypeStruct((offset,), jnp.uint8)

    def pack(self, *trees) -> np.ndarray:
        """One tree as a buffer, or several as its rows."""
        size = self.spec.shape[0]
        # Copied through a memoryview, which keeps the GIL (see `zeros`).
        buf = bytearray(size * len(trees))
        view = memoryview(buf)
        for i, tree in enumerate(trees):
            leaves = jax.tree.leaves(tree)
            for (offset, shape, dtype), leaf in zip(self._fields, leaves, strict=True):
                data = np.asarray(leaf, dtype)
                if data.shape != shape:
                    raise ValueError(f"a field of shape {shape} got an array of {data.shape}")
                start = i * size + offset
                view[start : start + data.nbytes] = np.ascontiguousarray(data.reshape(-1)).view(
                    np.uint8
                )
        out = np.frombuffer(buf, np.uint8)
        return out if len(trees) == 1 else out.reshape(len(trees), size)

    def unpack(self, buf: jax.Array):
        leaves = []
        for offset, shape, dtype in self._fields:
            data = buf[offset : offset + math.prod(shape) * dtype.itemsize]
            if dtype == np.bool_:
                data = data != 0
            elif dtype.itemsize > 1:
                data = jax.lax.bitcast_convert_type(data.reshape(-1, dtype.itemsize), dtype)
            else:
                data = jax.lax.bitcast_convert_type(data, dtype)
            leaves.append(data.reshape(shape))
        return self._treedef.unflatten(leaves)
