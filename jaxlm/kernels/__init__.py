"""Native CPU kernels run inside jitted steps as XLA FFI custom calls: products with quantized
and 16-bit weights, and rows gathered from a 16-bit table.

The library (`csrc/`, C++17) is compiled by `pip install` and called through `jax.ffi`: XLA
runs it as a custom call on its own threads, with no Python and no GIL, and the weights are
read where they lie, packed. Three products, each with a path per instruction set chosen when
it runs (AVX512-VNNI, AVX2, portable C++):

- `w8_matmul`: int8 weights `[..., out, in]` with one float32 scale per row, as
  `jaxlm.ops.quantize_weight` stores them; each column of the activations is rotated as the
  weights' input was and rounded to two int8 digits, as `jaxlm.ops.quantized_matmul` rounds
  them for XLA's integer dot.
- `w4_matmul`: 4-bit weights in blocks of 32 with a float16 scale and minimum each
  (`jaxlm.kernels.int4`); the activations are rounded to int8 per block of 32.
- `w16_matmul`: bfloat16 or float16 weights and a few columns, widened to float32 in
  registers (bfloat16 multiplied as it is where the CPU has AVX512-BF16, the `avx512_bf16`
  path); XLA:CPU streams such a product at a third of the machine's bandwidth.

Beside them, `rows` copies a table's rows where it lies, for any dtype: XLA:CPU gathers 16-bit
float rows from a float32 copy of the whole table; and `attend` runs a few queries per row over
the KV cache's pages where they lie, which XLA gathers into a copy first.

Where the library was not built (no compiler, another platform) or is switched off
(`JAXLM_NATIVE_KERNELS=0`, read as products are traced), `available()` is false and
`jaxlm.ops` runs XLA's products; a missing library is reported once, as a warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# The paths of each kernel, from the most portable (the library's `jaxlm::Isa`).
ISAS = ("portable", "avx2", "avx512_vnni", "avx512_bf16")
# The environment variable that switches the library off (`0`).
SWITCH = "JAXLM_NATIVE_KERNELS"
# The int32 sums of `w8_matmul` hold up to this many inputs: 255 * 127 * in < 2**31.
W8_MAX_IN = 65536
# The most columns `w16_matmul` takes: one accumulator each in registers.
W16_MAX_COLUMNS = 8

_TARGETS = {
    "jaxlm_w8_matmul": "JaxlmW8Matmul",
    "jaxlm_w4_matmul": "JaxlmW4Matmul",
    "jaxlm_w16_matmul": "JaxlmW16Matmul",
    "jaxlm_rows": "JaxlmRows",
    "jaxlm_attend": "JaxlmAttend",
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("jaxlm.kernels._native")
    try:
        if spec is None or spec.origin is None:
            raise OSError("the library was not built at install")
        library = ctypes.CDLL(spec.origin)
    except OSError as e:
        warnings.warn(
            f"jaxlm: native CPU kernels unavailable ({e}); quantized products and rows of tied "
            "16-bit embeddings run through XLA",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    for target, symbol in _TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    return library


def available() -> bool:
    """Whether the native products run here: built, loaded, and not switched off with
    `JAXLM_NATIVE_KERNELS=0`."""
    return os.environ.get(SWITCH, "1") != "0" and _library() is not None


def runs_here() -> bool:
    """Whether `jaxlm.ops` runs the kernels: available, on one CPU device (a custom call's
    operands are not split over a mesh)."""
    return available() and jax.default_backend() == "cpu" and jax.device_count() == 1


def products() -> str:
    """The quantized products `jaxlm.ops` runs here, as `jaxlm bench` reports them:
    `native (<path>)` or `XLA`."""
    return f"native ({isa()})" if runs_here() else "XLA"


def isa() -> str | None:
    """The path the kernels take (one of `ISAS`), or None where the library is unavailable."""
    library = _library()
    if library is None:
        return None
    return ISAS[library.JaxlmKernelsLimitIsa(ctypes.c_int(_limit))]


def cpu_isas() -> tuple[str, ...]:
    """The paths this CPU can run, from the most portable; empty without the library."""
    library = _library()
    return () if library is None else ISAS[: library.JaxlmKernelsBestIsa() + 1]


_limit = len(ISAS) - 1


@contextlib.contextmanager
def limited_to(name: str):
    """Runs the kernels on path `name` (one of `ISAS`) or the best below it the CPU has,
    within the block; tests force every path a machine can run this way. The path is chosen
    as each product runs, so compiled steps need not be compiled again."""
    global _limit
    if name not in ISAS:
        raise ValueError(f"`name` must be one of {', '.join(f'`{n}`' for n in ISAS)}, got {name!r}")
    library = _registered()
    previous, _limit = _limit, ISAS.index(name)
    library.JaxlmKernelsLimitIsa(ctypes.c_int(_limit))
    try:
        yield
    finally:
        _limit = previous
        library.JaxlmKernelsLimitIsa(ctypes.c_int(previous))


def _registered() -> ctypes.CDLL:
    # The custom calls' targets are registered as the library loads.
    library = _library()
    if library is None:
        raise RuntimeError("jaxlm's native CPU kernels are unavailable here")
    return library


def _columns(x: jax.Array, k: int, name: str) -> jax.Array:
    if x.ndim < 1 or x.shape[0] != k:
        raise ValueError(f"`x` must be [{name}, ...] with {name} = {k}, got shape {x.shape}")
    return x.reshape(k, math.prod(x.shape[1:])).astype(jnp.float32)


def w8_matmul(
    q: jax.Array, scale: jax.Array, x: jax.Array, signs: jax.Array, block: int
) -> jax.Array:
    """`w @ x` for int8 `q` `[..., out, in]` with float32 `scale` `[..., out]` (one per row),
    stored after a rotation of their input (`jaxlm.ops.quantize_weight`), and feature-major `x`
    `[in, ...]`: `[..., out, ...]` in float32. Each column of `x` is rotated inside as the
    weight's input was, multiplied by `signs` `[in]` and then by orthonormal Hadamard blocks of
    `block` inputs (a power of two dividing `in`), and rounded to two int8 digits (see
    `jaxlm.ops.quantized_matmul`).

    Example:
        >>> y = jaxlm.kernels.w8_matmul(q, scale, x, signs, 64)
    """
    _registered()
    if q.dtype != jnp.int8 or q.ndim < 2:
        raise ValueError(f"`q` must be int8 [..., out, in], got {q.dtype} {q.shape}")
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"`scale` must be [..., out] = {q.shape[:-1]}, got {scale.shape}")
    k = q.shape[-1]
    if k > W8_MAX_IN:
        raise ValueError(f"`q` may have at most {W8_MAX_IN} inputs, got {k}")
    if jnp.shape(signs) != (k,):
        raise ValueError(f"`signs` must be [in] = [{k}], got shape {jnp.shape(signs)}")
    if block < 1 or block & (block - 1) or k % block:
        raise ValueError(f"`block` must be a power of two dividing in = {k}, got {block}")
    flat = _columns(x, k, "in")
    out = jax.ShapeDtypeStruct((*q.shape[:-1], flat.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call("jaxlm_w8_matmul", out)
    y = call(q, scale.astype(jnp.float32), flat, jnp.asarray(signs, jnp.float32), block=block)
    return y.reshape(*q.shape[:-1], *x.shape[1:])


def w4_matmul(packed: jax.Array, scales: jax.Array, x: jax.Array) -> jax.Array:
    """`w @ x` for 4-bit weights stored by `jaxlm.kernels.int4` (`packed` uint8 `[..., out,
    in / 2]`, `scales` float16 `[..., out, in / 32, 2]`) and feature-major `x` `[in, ...]`:
    `[..., out, ...]` in float32, `x` rounded to int8 per block of 32 inside.

    Example:
        >>> y = jaxlm.kernels.w4_matmul(packed, scales, x)
    """
    _registered()
    if packed.dtype != jnp.uint8 or packed.ndim < 2:
        raise ValueError(f"`packed` must be uint8 [..., out, in / 2], got {packed.dtype}")
    k = 2 * packed.shape[-1]
    if k % 32:
        raise ValueError(f"`packed` must hold a multiple of 32 inputs per row, got {k}")
    expected = (*packed.shape[:-1], k // 32, 2)
    if scales.dtype != jnp.float16 or scales.shape != expected:
        raise ValueError(f"`scales` must be float16 {expected}, got {scales.dtype} {scales.shape}")
    flat = _columns(x, k, "in")
    out = jax.ShapeDtypeStruct((*packed.shape[:-1], flat.shape[1]), jnp.float32)
    y = jax.ffi.ffi_call("jaxlm_w4_matmul", out)(packed, scales, flat)
    return y.reshape(*packed.shape[:-1], *x.shape[1:])


def w16_matmul(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w @ x` for bfloat16 or float16 `w` `[..., out, in]` and feature-major `x` `[in, ...]` of
    at most `W16_MAX_COLUMNS` columns: `[..., out, ...]` in float32. `x` is rounded to `w`'s
    dtype first, as `jaxlm.ops.matmul` gives it to XLA's product, and the products are summed in
    float32.

    Example:
        >>> y = jaxlm.kernels.w16_matmul(w, x)
    """
    _registered()
    if w.dtype not in (jnp.bfloat16, jnp.float16) or w.ndim < 2:
        raise ValueError(f"`w` must be bfloat16 or float16 [..., out, in], got {w.dtype} {w.shape}")
    flat = _columns(x.astype(w.dtype), w.shape[-1], "in")
    if flat.shape[1] > W16_MAX_COLUMNS:
        raise ValueError(f"`x` may have at most {W16_MAX_COLUMNS} columns, got {flat.shape[1]}")
    out = jax.ShapeDtypeStruct((*w.shape[:-1], flat.shape[1]), jnp.float32)
    y = jax.ffi.ffi_call("jaxlm_w16_matmul", out)(w, flat)
    return y.reshape(*w.shape[:-1], *x.shape[1:])


def rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` `[...]` of `table` `[rows, features]`, of any dtype: `[..., features]`,
    copied where the table lies. As `jnp.take(table, ids, axis=0)` gathers them: a negative id
    counts from the end, and the row of an id outside the table is all ones (NaN for floats).

    Example:
        >>> x = jaxlm.kernels.rows(embedding, input_ids)
    """
    _registered()
    if table.ndim != 2:
        raise ValueError(f"`table` must be [rows, features], got shape {table.shape}")
    flat = jnp.asarray(ids, jnp.int32).reshape(-1)
    out = jax.ShapeDtypeStruct((flat.shape[0], table.shape[1]), table.dtype)
    return jax.ffi.ffi_call("jaxlm_rows", out)(table, flat).reshape(*jnp.shape(ids), table.shape[1])


def attend(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table: jax.Array,
    mask: jax.Array,
    scale: float,
) -> jax.Array:
    """`jaxlm.ops.attend` of queries `q` `[heads, D, B, T]` over the pages that `table` `[B, P]`
    lists for each row, read where they lie: keys `k_pages` `[pages, kv_heads, D, S]` and values
    `v_pages` `[pages, kv_heads, S, D]`, float32 or bfloat16 stored as uint16
    (`jaxlm.ops.storage_dtype`), where `mask` `[B, T, P * S]` holds, scores scaled by `scale`:
    `[heads * D, B, T]` in float32. Every product and sum is in float32; a query that sees no
    slot gives zeros.

    Example:
        >>> out = jaxlm.kernels.attend(q, k_pages, v_pages, table, mask, 0.125)
    """
    _registered()
    heads, d, b, t = q.shape
    kv = k_pages.shape[1] if k_pages.ndim == 4 else 0
    if k_pages.ndim != 4 or k_pages.shape[2] != d or kv < 1 or heads % kv:
        raise ValueError(
            f"`k_pages` must be [pages, kv_heads, {d}, size] with kv_heads dividing {heads}, "
            f"got shape {k_pages.shape}"
        )
    n, kv, _, size = k_pages.shape
    if v_pages.shape != (n, kv, size, d) or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"`v_pages` must be {k_pages.dtype} {(n, kv, size, d)}, got {v_pages.dtype} "
            f"{v_pages.shape}"
        )
    if k_pages.dtype not in (jnp.float32, jnp.uint16):
        raise ValueError(f"`k_pages` must be float32 or uint16, got {k_pages.dtype}")
    if table.ndim != 2 or table.shape[0] != b:
        raise ValueError(f"`table` must be [{b}, pages per row], got shape {table.shape}")
    if mask.shape != (b, t, table.shape[1] * size):
        raise ValueError(f"`mask` must be {(b, t, table.shape[1] * size)}, got shape {mask.shape}")
    out = jax.ShapeDtypeStruct((heads * d, b, t), jnp.float32)
    return jax.ffi.ffi_call("jaxlm_attend", out)(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        table.astype(jnp.int32),
        mask.astype(jnp.bool_),
        scale=np.float32(scale),
    )
