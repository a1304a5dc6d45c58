"""The products and cache accesses whose best lowering depends on the backend.

The model and the layers say what to compute (`matmul`, `attend_paged`, `write_paged`, ...);
this package decides how, and is the only place that asks which backend runs it: products
here, the KV cache and attention in `jaxlm.ops.attention`. Each variant
names its backend and the reason in a sentence; the measurements behind them are in
`docs/performance.md`, by section.

Conventions: weights are `[out, in]` and activations feature-major, `[features, ...]`, so a
product is `w @ x` with the weight as its left operand (see `docs/performance.md`, "Operand
order"). Products accumulate in float32.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import kernels
from jaxlm.kernels import int4
from jaxlm.ops.attention import (  # noqa: F401 (the cache and attention, re-exported)
    PAGE_BY_PAGE,
    attend,
    attend_paged,
    gather_pages,
    paged_kv_specs,
    read_cache,
    storage_dtype,
    to_cache_layout,
    write_cache,
    write_paged,
)
from jaxlm.ops.backend import platform


@functools.cache
def _cpu_threads() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _multithreaded_cpu() -> bool:
    """One CPU device with several threads: where XLA:CPU's own thread split is the bottleneck
    (on several devices, the operands are sharded instead)."""
    return platform() == "cpu" and _cpu_threads() > 1 and jax.device_count() == 1


# Products.

# XLA:CPU runs a bfloat16 product natively (YNNPACK) from this many columns of `x` on.
_NATIVE_BF16_COLUMNS = 2
# The most columns of a bfloat16 product the native kernel runs without AVX512-BF16: it led
# XLA:CPU's product at 1 to 4 columns and not at 8; with AVX512-BF16, and for float16 (whose
# XLA product converts a float32 copy), at every count up to its own limit (see
# `docs/performance.md`, "16-bit products").
_NATIVE_BF16_WIDENED_COLUMNS = 4
# A one-column product on CPU runs as a batched dot of this many parts of its matrix.
_GEMV_PARTS = 8


def matmul(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w @ x` for `w` `[..., out, in]` and feature-major `x` `[in, ...]`: `[..., out, ...]`,
    accumulated in float32. Leading dimensions of `w` stack matrices that multiply the same `x`
    as one product.

    Variants:
    - CPU, one device, 16-bit weights up to 8 columns (bfloat16 up to 4 without AVX512-BF16):
      the native kernel (`jaxlm.kernels.w16_matmul`), which reads the weights at the machine's
      bandwidth where XLA:CPU's bfloat16 product read a third of it, and its float16 one
      converts a float32 copy (see `docs/performance.md`, "16-bit products").
    - CPU, bfloat16 weights, one column, without the kernel: padded to two columns. With one,
      XLA:CPU computes in float32 from a converted copy of the weight, which it hoists out of
      the decode loop: a float32 copy of every weight (see `docs/performance.md`, "bfloat16 at
      batch 1").
    - CPU with several threads, one column, rows divisible by 8: a batched dot of 8 parts of
      the matrix, which the threads share; XLA:CPU gives a small matrix-vector product to one
      thread (see `docs/performance.md`, "Matrix-vector products in parts").
    - Otherwise one `dot_general`.
    """
    cols = math.prod(x.shape[1:])
    if w.dtype in (jnp.bfloat16, jnp.float16) and kernels.runs_here():
        most = kernels.W16_MAX_COLUMNS
        if w.dtype == jnp.bfloat16 and kernels.isa() != "avx512_bf16":
            most = _NATIVE_BF16_WIDENED_COLUMNS
        if cols <= most:
            return kernels.w16_matmul(w, x)
    if platform() == "cpu" and w.dtype == jnp.bfloat16 and cols < _NATIVE_BF16_COLUMNS:
        return _padded_to_native_columns(w, x, cols)
    if cols == 1 and _multithreaded_cpu() and (w.size // w.shape[-1]) % _GEMV_PARTS == 0:
        return _in_parts(w, x, _GEMV_PARTS)
    dims = (((w.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(w, x.astype(w.dtype), dims, preferred_element_type=jnp.float32)


def _padded_to_native_columns(w: jax.Array, x: jax.Array, cols: int) -> jax.Array:
    flat = jnp.pad(x.reshape(x.shape[0], cols), ((0, 0), (0, _NATIVE_BF16_COLUMNS - cols)))
    return matmul(w, flat)[..., :cols].reshape(*w.shape[:-1], *x.shape[1:])


def _in_parts(w: jax.Array, x: jax.Array, parts: int) -> jax.Array:
    # `w` viewed as `[parts, rows / parts, in]` (a bitcast): one matrix-vector product per part,
    # in a batched dot whose batch XLA:CPU spreads over its threads.
    k = w.shape[-1]
    xs = jnp.broadcast_to(x.reshape(1, k, 1).astype(w.dtype), (parts, k, 1))
    dims = (((2,), (1,)), ((0,), (0,)))
    y = jax.lax.dot_general(w.reshape(parts, -1, k), xs, dims, preferred_element_type=jnp.float32)
    return y.reshape(*w.shape[:-1], *x.shape[1:])


# On CPU, a chunk of this many columns runs through the MLP in two halves.
_HALVED_COLUMNS = range(64, 257)


def mlp_column_parts(cols: int) -> int:
    """In how many parts of its columns an MLP runs `cols` columns (a chunk of tokens).

    CPU with several threads, an even number of columns from 64 to 256: two halves, each
    through all three products, ran faster than the whole chunk; with more columns, or more
    parts, they did not (see `docs/performance.md`, "The MLP in two halves").
    """
    return 2 if _multithreaded_cpu() and cols in _HALVED_COLUMNS and cols % 2 == 0 else 1


# A mixture-of-experts layer gathers its chosen experts' weights while they are at most this
# share of all its experts' weights.
_GATHERED_SHARE = 1 / 4


def expert_storage(weight: jax.Array) -> jax.Array:
    """Stacked experts' weights `[experts, ...]` as stored: on CPU, 16-bit ones as their
    `uint16` bits, which `expert_products` reads.

    XLA:CPU gathers or slices 16-bit floats from a float32 copy of the whole array, hoisted out
    of the decode loop: a float32 copy of every expert. Their bits gather in place, exactly, as
    an embedding table's (see `embedding_storage`).
    """
    if weight.dtype.itemsize == 2 and platform() == "cpu":
        return jax.lax.bitcast_convert_type(weight, jnp.uint16)
    return weight


def expert_products(x, gate_up, down, index, weight, activation, dtype):
    """A mixture of gated MLPs: each token's `sum_j weight[n, j] * down_e(activation(gate_e(x))
    * up_e(x))` over its chosen experts `e = index[n, j]`, for `x` `[hidden, N]`, `gate_up`
    `[experts, 2 * inter, hidden]` (gate rows, then up), `down` `[experts, hidden, inter]`,
    stored by `expert_storage` for `dtype`, and `index` and `weight` `[N, top_k]`; returns
    `[hidden, N]` (float32).

    Variants:
    - Few tokens (a decode step): the chosen experts' weights gathered and only those
      multiplied, a cost that grows with `top_k` and not with the experts.
    - More tokens, from a quarter of the experts' weights on: every expert multiplied, the
      unchosen weighed by zero, which ran faster than copying each token's experts out (see
      `docs/performance.md`, "Expert products"). Weights stored as bits go one expert at a
      time, each sliced as gathering does; others as one product, which a mesh splits by
      expert.
    """
    f32, experts = jnp.float32, gate_up.shape[0]

    def values(w):
        return jax.lax.bitcast_convert_type(w, dtype) if w.dtype == jnp.uint16 else w

    if index.size <= _GATHERED_SHARE * experts:
        # Token by token, each product through `matmul`, whose one-column variants run
        # natively: a batched one-column dot converted the gathered experts to float32.
        ys = []
        for n, (chosen, w) in enumerate(zip(index, weight, strict=True)):
            up_gate = values(jnp.take(gate_up, chosen, axis=0))  # [top_k, 2 * inter, hidden]
            gate, up = jnp.split(matmul(up_gate, x[:, n : n + 1]), 2, axis=1)
            h = activation(gate) * up * w[:, None, None]  # [top_k, inter, 1]
            downs = values(jnp.take(down, chosen, axis=0))  # [top_k, hidden, inter]
            ys.append(sum(matmul(d, part) for d, part in zip(downs, h, strict=True)))
        return jnp.concatenate(ys, axis=1)
    # [experts, N]: each token's weight of each expert, zero where it did not choose it.
    dense = jnp.sum(jax.nn.one_hot(index, experts, dtype=f32) * weight[..., None], axis=1).T
    if gate_up.dtype == jnp.uint16:

        def expert(y, e):
            gate, up = jnp.split(matmul(values(gate_up[e]), x), 2)  # [inter, N] each
            return y + matmul(values(down[e]), activation(gate) * up * dense[e]), None

        return jax.lax.scan(expert, jnp.zeros(x.shape, f32), jnp.arange(experts))[0]
    gate, up = jnp.split(matmul(gate_up, x), 2, axis=1)  # [experts, inter, N] each
    h = activation(gate) * up * dense[:, None]
    # Batched by expert, the weights as they lie: contracting the experts too made XLA copy
    # `down` transposed.
    dims = (((2,), (1,)), ((0,), (0,)))
    return jax.lax.dot_general(down, h.astype(dtype), dims, preferred_element_type=f32).sum(0)


def rows_last(y: jax.Array) -> jax.Array:
    """A feature-major product's result `[features, ...]` as `[..., features]`.

    The barrier keeps XLA from making the transposed product a product of the transposed
    operands, with a 16-bit weight on the right and the activations transposed on the left,
    which XLA:CPU's YNNPACK declines and its own dot cannot run.
    """
    return jnp.moveaxis(jax.lax.optimization_barrier(y), 0, -1)


def computed_once(predicate: jax.Array, fn, otherwise, *operands):
    """`fn(*operands)` where `predicate` holds, else `otherwise(*operands)`, materialised once.

    XLA:CPU fuses a cheap producer (the rotary angles' `cos` and `sin`) into each of its
    consumers and so computes it again for every layer; a conditional's results are
    materialised. `predicate` must be one XLA cannot fold: it removes optimization barriers
    (see `docs/performance.md`, "Rotary angles once").
    """
    return jax.lax.cond(predicate, fn, otherwise, *operands)


def before_layout(live: jax.Array, fn, q: jax.Array, k: jax.Array):
    """`fn(q, k)` on a chunk's queries and keys `[heads, D, B, T]`, computed on CPU before the
    copies that lay them out for attention and for the page write where the chunk is a
    prompt's (more than `PAGE_BY_PAGE` tokens); a chunk that is padding in every row (`live`
    false) gives them back unchanged.

    Fused into those transposing copies, XLA:CPU runs an elementwise `fn` (the rotary
    embedding) in their scattered order, at several times the copies' own time; materialised
    by a conditional (`computed_once`), it runs in the product's order. One token or a few go
    through the copies with `fn` fused, where the conditional would cost more than it saves
    (see `docs/performance.md`, "A prompt chunk's rotation").
    """
    if platform() != "cpu" or q.shape[-1] <= PAGE_BY_PAGE:
        return fn(q, k)
    return computed_once(live, fn, lambda q, k: (q, k), q, k)


def while_loop(cond, body, init, most):
    """`jax.lax.while_loop(cond, body, init)` for a loop known to stop within `most` iterations.

    XLA's loop passes look for each loop's induction variable; in a loop whose condition reads
    only values its body computes, they copy out every instruction those depend on, a model's
    whole forward, pass after pass; a counter the condition compares with `most` is found at
    once (see `docs/performance.md`, "Compiling loops"). `most` must not cut the loop short.
    """
    counted = jax.lax.while_loop(
        lambda c: (c[0] < most) & cond(c[1]),
        lambda c: (c[0] + 1, body(c[1])),
        (jnp.int32(0), init),
    )
    return counted[1]


# 8-bit products.

# On CPU, jaxlm's native int8 product runs up to this many columns, XLA's integer dot more,
# except on the native AVX512-VNNI path, which ran every number of columns faster.
_NATIVE_W8_COLUMNS = 8

# Weights are rotated along their input in blocks of up to this many features.
_ROTATION_BLOCK = 64
# The second int8 digit of an activation counts steps this many times finer than the first's.
_DIGIT = 254


@functools.cache
def _rotation(features: int) -> tuple[np.ndarray, np.ndarray]:
    """The rotation of `features` inputs: random signs `[features]`, then an orthonormal
    Hadamard matrix `[b, b]` applied to blocks of `b` features, the largest power of two up to
    `_ROTATION_BLOCK` that divides `features`."""
    signs = np.random.default_rng(features).choice(np.float32([-1, 1]), features)
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < math.gcd(features, _ROTATION_BLOCK):
        h = np.block([[h, h], [h, -h]])
    return signs, h / np.float32(np.sqrt(h.shape[0]))


def _rotate(a: jax.Array, axis: int, inverse: bool = False) -> jax.Array:
    """`a` with its dimension `axis` rotated by `_rotation` (or rotated back): an orthogonal
    map, so rotating a weight's input and the activations it multiplies leaves the product
    unchanged."""
    a = jnp.moveaxis(a.astype(jnp.float32), axis, -1)
    signs, h = _rotation(a.shape[-1])
    if not inverse:
        a = a * signs
    blocks = a.reshape(*a.shape[:-1], -1, h.shape[0])
    # The Hadamard matrix is symmetric: its own transpose.
    a = jnp.matmul(blocks, h, precision=jax.lax.Precision.HIGHEST).reshape(a.shape)
    if inverse:
        a = a * signs
    return jnp.moveaxis(a, -1, axis)


def quantize_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A weight `[..., out, in]` as int8 and one float32 scale per output row `[..., out]`,
    after rotating its input (see `quantized_matmul`): symmetric, rounded to nearest."""
    w = _rotate(w, -1)
    scale = jnp.max(jnp.abs(w), axis=-1) / 127
    q = jnp.round(w / jnp.where(scale == 0, 1, scale)[..., None])
    return q.astype(jnp.int8), scale


def quantized_rows(q: jax.Array, scale: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` `[...]` of a table stored by `quantize_weight` (an embedding), as float32
    `[..., features]`: dequantized, then rotated back; or of a 4-bit table (uint8 `q`, see
    `jaxlm.kernels.int4`), dequantized."""
    if q.dtype == jnp.uint8:
        return int4.rows(q, scale, ids)
    rows = jnp.take(q, ids, axis=0).astype(jnp.float32) * jnp.take(scale, ids)[..., None]
    return _rotate(rows, -1, inverse=True)


def quantized_matmul(q: jax.Array, scale: jax.Array, x: jax.Array) -> jax.Array:
    """`w @ x` for a weight stored by `quantize_weight` and feature-major float `x` `[in,
    ...]`: `[..., out, ...]` in float32.

    Variants:
    - CPU: each column of `x` is rounded to two int8 digits sharing one scale, the second
      counting the first's remainder in steps 254 times finer, and both multiply the int8
      weight in one `s8 x s8 -> s32` dot of twice the columns, which XLA:CPU runs natively
      (one column becomes two, which it needs), then are rescaled and added in float32. With
      one digit the activations' rounding costs ten times the weights' in divergence; with
      two it is negligible, and the rotation of the input (random signs and Hadamard blocks,
      folded into the weight) halves what the weights' rounding costs (see
      `docs/performance.md`, "8-bit products").
    - One CPU device with jaxlm's native kernels (`jaxlm.kernels`), up to 8 columns, or any
      number on their AVX512-VNNI path: the same two digits, in a custom call that rotates the
      input itself (two fewer operations a product for XLA to run) and reads the int8 weight
      once for both digits; XLA's integer dot streamed the weights at a third of the
      memory's speed, but ran more columns (a prompt chunk) faster than the kernels did
      before their AVX512-VNNI path kept its sums in registers; the other paths were not
      measured again (see `docs/performance.md`, "Native products").
    - Otherwise the int8 weight is converted inside a bfloat16 dot and its rows scaled after,
      the weight-only product that GPU and TPU compilers fuse.

    A 4-bit weight (uint8 `q`, `scale` its blocks' scales, see `jaxlm.kernels.int4`) runs the
    native 4-bit product where the kernels run, else XLA's product of the dequantized weight.
    """
    native = kernels.runs_here()
    if q.dtype == jnp.uint8:
        if native:
            return kernels.w4_matmul(q, scale, x)
        return int4.matmul(q, scale, x.reshape(x.shape[0], -1)).reshape(*q.shape[:-1], *x.shape[1:])
    k = q.shape[-1]
    cols = math.prod(x.shape[1:])
    vnni = kernels.isa() in kernels.ISAS[2:]
    if native and k <= kernels.W8_MAX_IN and (cols <= _NATIVE_W8_COLUMNS or vnni):
        signs, h = _rotation(k)
        return kernels.w8_matmul(q, scale, x, signs, h.shape[0])
    flat = _rotate(x.reshape(k, cols), 0)
    dims = (((q.ndim - 1,), (0,)), ((), ()))
    if platform() == "cpu":
        y = _in_two_digits(q, flat.astype(jnp.float32), dims)
    else:
        bf16 = jnp.bfloat16
        y = jax.lax.dot_general(
            q.astype(bf16), flat.astype(bf16), dims, preferred_element_type=jnp.float32
        )
    y = y * scale[..., None]
    return y.reshape(*q.shape[:-1], *x.shape[1:])


def _in_two_digits(q: jax.Array, x: jax.Array, dims) -> jax.Array:
    # x [in, cols] -> digits [in, 2 * cols]: hi in the first `cols` columns, lo in the rest.
    cols = x.shape[1]
    step = jnp.max(jnp.abs(x), axis=0) / 127
    step = jnp.where(step == 0, 1, step)
    hi = jnp.round(x / step)
    lo = jnp.clip(jnp.round((x - hi * step) * (_DIGIT / step)), -127, 127)
    digits = jnp.concatenate([hi, lo], axis=1).astype(jnp.int8)
    acc = jax.lax.dot_general(q, digits, dims, preferred_element_type=jnp.int32)
    acc = acc.astype(jnp.float32)
    return acc[..., :cols] * step + acc[..., cols:] * (step / _DIGIT)


# Embedding tables.


def embedding_storage(weight: jax.Array, tied: bool) -> jax.Array:
    """An embedding table as stored: on CPU, an untied 16-bit table as its `uint16` bits.

    XLA:CPU gathers 16-bit float rows from a float32 copy of the whole table, hoisted out of
    the decode loop, and a bitcast of the whole table is hoisted as a copy too; rows of the
    bits gather in place and exactly. A tied table keeps its floats for the LM head's product.
    """
    if weight.dtype.itemsize == 2 and not tied and platform() == "cpu":
        return jax.lax.bitcast_convert_type(weight, jnp.uint16)
    return weight


def embedding_rows(weight: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` `[...]` of a table stored by `embedding_storage` for `dtype`, as float32
    `[..., features]`. On CPU a tied 16-bit table, kept as floats, gathers in place through
    `jaxlm.kernels.rows` where the native kernels run, else from its bits, which XLA copies
    whole each call (see `docs/performance.md`, "Embedding tables as bits")."""
    dtype = jnp.dtype(dtype)
    if weight.dtype == jnp.uint16:
        rows = jax.lax.bitcast_convert_type(jnp.take(weight, ids, axis=0), dtype)
    elif dtype.itemsize == 2 and kernels.runs_here():
        rows = kernels.rows(weight, ids)
    elif dtype.itemsize == 2 and platform() == "cpu":
        bits = jax.lax.bitcast_convert_type(weight, jnp.uint16)
        rows = jax.lax.bitcast_convert_type(jnp.take(bits, ids, axis=0), dtype)
    else:
        rows = jnp.take(weight, ids, axis=0)
    return rows.astype(jnp.float32)
