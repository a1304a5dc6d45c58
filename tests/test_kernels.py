"""The native CPU products (`jaxlm.kernels`) against NumPy computations of the same quantized
and 16-bit products, on every path this CPU runs, and its rows against NumPy's; the 4-bit
format against `gguf.quants`; bad input; the fallback to XLA's products; the C++ sources'
formatting."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import clang_format
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_bench import load_benchmark
from test_int8 import rotation

from jaxlm import kernels, ops
from jaxlm.kernels import int4

CSRC = Path(kernels.__file__).parent / "csrc"
COLUMNS = (1, 2, 3, 8, 64)
# From 24 columns on, the AVX512-VNNI paths multiply panels of 16 rows; the panels and the 4-bit
# rows take columns four at a time, then the 3, 2 or 1 left.
PANEL_COLUMNS = (*COLUMNS, 25, 26, 27)
W4_COLUMNS = (*PANEL_COLUMNS, 17)
# Every path of the kernels this CPU runs; the library is built by `pip install`.
ISAS = kernels.cpu_isas()


def test_library_is_built_and_runs_the_best_path():
    assert kernels.available()
    assert ISAS[0] == "portable" and kernels.isa() == ISAS[-1]


def rotate(x: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """`x` `[in, cols]` times `signs`, then each block of `block` inputs times the orthonormal
    Hadamard matrix, as butterflies in float64, rounded to float32 at the end."""
    v = x.astype(np.float64) * signs[:, None]
    h = 1
    while h < block:
        pairs = v.reshape(-1, 2, h, v.shape[1])
        v = np.stack([pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]], 1).reshape(v.shape)
        h *= 2
    return (v / np.sqrt(block)).astype(np.float32)


def w8_reference(
    q: np.ndarray, scale: np.ndarray, x: np.ndarray, signs: np.ndarray, block: int
) -> np.ndarray:
    """`jaxlm.ops.quantized_matmul`'s product: each column of `x` rotated, rounded to two int8
    digits, multiplied exactly, rescaled in float32 as the kernel does."""
    x = rotate(x, signs, block)
    step = np.abs(x).max(0) / np.float32(127)
    step = np.where(step == 0, np.float32(1), step)
    hi = np.round(x / step)
    lo = np.clip(np.round((x - hi * step) * (np.float32(254) / step)), -127, 127)
    w = q.reshape(-1, q.shape[-1]).astype(np.int64)
    sums_hi = (w @ hi.astype(np.int64)).astype(np.float32)
    sums_lo = (w @ lo.astype(np.int64)).astype(np.float32)
    y = (sums_hi * step + sums_lo * (step / np.float32(254))) * scale.reshape(-1, 1)
    return y.reshape(*q.shape[:-1], x.shape[1])


def test_the_reference_rotation_is_the_int8_weights_rotation():
    # With the signs `jaxlm.ops` draws for 96 inputs and its block of 32, `rotate` is the
    # rotation `tests/test_int8.py` writes out as a matrix.
    x = np.random.default_rng(0).standard_normal((96, 3), np.float32)
    signs = np.random.default_rng(96).choice(np.float32([-1, 1]), 96)
    np.testing.assert_allclose(rotate(x, signs, 32), rotation(96) @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cols", PANEL_COLUMNS)
@pytest.mark.parametrize(
    "shape, block",
    [
        ((1, 1), 1),
        ((7, 33), 1),
        ((13, 64), 64),
        ((2, 5, 200), 8),
        ((3, 96), 32),
        ((4, 192), 64),
        ((9, 577), 1),
        ((37, 130), 2),
    ],
)
def test_w8_equals_numpy(isa, cols, shape, block):
    rng = np.random.default_rng(cols)
    q = rng.integers(-128, 128, shape, dtype=np.int8)
    scale = rng.random(shape[:-1], np.float32)
    x = rng.standard_normal((shape[-1], cols), np.float32)
    x[:, 0] *= 1e3  # columns on their own scales
    if cols > 2:
        x[:, 2] = 0  # a column of zeros: its step is 1
    signs = rng.choice(np.float32([-1, 1]), shape[-1])
    with kernels.limited_to(isa):
        y = jax.jit(kernels.w8_matmul, static_argnums=4)(q, scale, x, signs, block)
    # Integer sums are exact; the rotation and the rescaling are the reference's, operation
    # for operation.
    np.testing.assert_array_equal(np.asarray(y), w8_reference(q, scale, x, signs, block))


def w4_reference(packed: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The 4-bit product: `x` rounded to int8 per block of 32 (step = max |x| / 127), the
    values multiplied exactly, each block's sum weighed by its scales, in float64."""
    k, cols = x.shape
    blocks = x.reshape(k // 32, 32, cols)
    step = np.abs(blocks).max(1) / np.float32(127)  # [blocks, cols]
    xq = np.round(blocks / np.where(step == 0, 1, step)[:, None]).astype(np.int64)
    q = np.asarray(int4.values(packed), np.int64).reshape(-1, k // 32, 32)
    dots = np.einsum("rbe,bec->rbc", q, xq).astype(np.float64)
    d, m = (scales.reshape(-1, k // 32, 2)[..., i, None].astype(np.float64) for i in (0, 1))
    y = (d * step * dots + m * step * xq.sum(1)).sum(1)
    return y.reshape(*packed.shape[:-1], cols)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cols", W4_COLUMNS)
# Rows past whole panels of 16 (the AVX512-VNNI path from 24 columns on) and past pairs of rows
# (below) among them, and rows of 0 to 3 blocks past whole super-blocks (the vector paths' four
# blocks at a time).
@pytest.mark.parametrize(
    "shape", [(1, 32), (5, 96), (3, 4, 160), (17, 576), (53, 96), (2, 20, 64), (6, 128)]
)
def test_w4_equals_numpy(isa, cols, shape):
    rng = np.random.default_rng(cols)
    w = rng.standard_normal(shape, np.float32)
    packed, scales = map(np.asarray, jax.jit(int4.quantize)(w))
    x = rng.standard_normal((shape[-1], cols), np.float32)
    x[:32, 0] = 0  # a block of zeros: its step is 0
    with kernels.limited_to(isa):
        y = np.asarray(jax.jit(kernels.w4_matmul)(packed, scales, x))
    expected = w4_reference(packed, scales, x)
    # The paths sum the blocks' float32 terms in other orders than NumPy's float64.
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
# Inputs past whole vectors of 16 and steps of 32 among them, and stacked matrices.
@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (3, 4, 80), (17, 576), (2, 9, 33)])
def test_w16_equals_numpy(isa, dtype, shape):
    rng = np.random.default_rng(shape[-1])
    w = jnp.asarray(rng.standard_normal(shape), dtype)
    for cols in (1, 2, 3, kernels.W16_MAX_COLUMNS):
        x = rng.standard_normal((shape[-1], cols)).astype(np.float32)
        x[:, 0] *= 1e3  # columns on their own scales
        with kernels.limited_to(isa):
            y = np.asarray(jax.jit(kernels.w16_matmul)(w, x))
        # Both operands as the product takes them (`x` rounded to `w`'s dtype), multiplied and
        # summed in float64; the kernel sums in float32, in its own order.
        a = np.asarray(w.astype(jnp.float32), np.float64).reshape(-1, shape[-1])
        b = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)
        bound = 4 * shape[-1] * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b))
        assert y.shape == (*shape[:-1], cols)
        assert np.all(np.abs(y.reshape(-1, cols) - a @ b) <= bound), (isa, cols)


def test_16_bit_products_of_a_few_columns_run_natively():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((24, 64)), jnp.bfloat16)
    # Up to the kernel's 8 columns; bfloat16 without AVX512-BF16 up to 4.
    for isa in ISAS[1:]:
        widened = isa != "avx512_bf16"
        with kernels.limited_to(isa):
            for cols in (1, 4, 5, 8, 9):
                x = jnp.ones((64, cols))
                assert custom_calls(ops.matmul, w, x) == (cols <= (4 if widened else 8))
                assert custom_calls(ops.matmul, w.astype(jnp.float16), x) == (cols <= 8)
    assert custom_calls(ops.matmul, w.astype(jnp.float32), jnp.ones((64, 1))) == 0
    # 16-bit products on the kernel give XLA's float32 sums, in another order.
    x = jnp.asarray(rng.standard_normal((64, 2)), jnp.float32)
    expected = w.astype(jnp.float32) @ x.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(ops.matmul(w, x), expected, rtol=1e-5, atol=1e-5)


def random_gguf_blocks(kind, count: int, rng) -> np.ndarray:
    """`count` blocks of `kind` with random nibbles and scales of every magnitude."""
    size = int4.GGUF_TYPES[kind]
    blocks = rng.integers(0, 256, (count, size), dtype=np.uint8)
    halves = rng.standard_normal((count, 2)) * 10.0 ** rng.integers(-5, 2, (count, 1))
    blocks[:, :4] = halves.astype(np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16, np.float32, np.int8])
def test_rows_equal_numpy(dtype):
    rng = np.random.default_rng(0)
    table = np.asarray(jnp.asarray(rng.standard_normal((50, 24)) * 40).astype(dtype))
    ids = np.array([[0, 49, -1, -50, 7], [50, -51, 1000, 3, 3]])
    inside = (ids >= -50) & (ids < 50)
    # `np.take` for the ids inside the table; all-ones bytes for the others, as `jnp.take`
    # fills a 16-bit table's bits.
    expected = np.take(table, np.where(inside, ids, 0), axis=0).view(np.uint8)
    expected[~inside] = 0xFF
    for rows in (kernels.rows, jax.jit(kernels.rows)):
        got = np.asarray(rows(jnp.asarray(table), ids))
        assert got.dtype == table.dtype and got.shape == (2, 5, 24)
        np.testing.assert_array_equal(got.view(np.uint8), expected)
    assert kernels.rows(jnp.asarray(table), np.zeros(0, np.int32)).shape == (0, 24)


@pytest.mark.parametrize("kind", list(int4.GGUF_TYPES))
def test_gguf_blocks_dequantize_exactly(kind):
    rng = np.random.default_rng(int(kind))
    shape = (6, 96)
    raw = random_gguf_blocks(kind, 6 * 96 // 32, rng)
    packed, scales = int4.from_gguf(raw.reshape(-1), kind, shape)
    expected = gguf.quants.dequantize(raw, kind).reshape(shape)
    np.testing.assert_array_equal(np.asarray(int4.dequantize(packed, scales)), expected)


def test_int4_quantize_rounds_to_the_nearest_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64), np.float32)
    packed, scales = int4.quantize(jnp.asarray(w))
    d = np.asarray(scales[..., 0], np.float32).repeat(32, -1)
    off = np.abs(np.asarray(int4.dequantize(packed, scales)) - w)
    # Within half a step, and the float16 rounding of the minimum.
    assert (off <= 0.5 * d + 1e-3 * np.abs(w).max()).all()
    assert packed.dtype == jnp.uint8 and scales.dtype == jnp.float16


def attention_inputs(rng, heads, kv, d, rows, width, size, per_row, half):
    """Random queries and pages, each row's pages listed out of order and some masked whole,
    and a mask with holes in which every query sees its row's first slot."""
    n = rows * per_row + 2
    q = rng.standard_normal((heads, d, rows, width), np.float32)
    k = rng.standard_normal((n, kv, d, size), np.float32)
    v = rng.standard_normal((n, kv, size, d), np.float32)
    table = rng.permutation(n)[: rows * per_row].reshape(rows, per_row).astype(np.int32)
    mask = rng.random((rows, width, per_row * size)) < 0.7
    mask[:, :, size : 2 * size] = False
    mask[:, :, 0] = True
    if half:
        k, v = (np.asarray(jnp.asarray(a, jnp.bfloat16).view(jnp.uint16)) for a in (k, v))
    return q, k, v, table, mask


def attention_reference(q, k, v, table, mask, scale):
    """Softmax attention in float64 over each row's pages laid end to end."""
    if k.dtype == np.uint16:
        k, v = ((a.astype(np.uint32) << 16).view(np.float32) for a in (k, v))
    heads, d, rows, width = q.shape
    group = heads // k.shape[1]
    out = np.zeros((heads, d, rows, width))
    for b in range(rows):
        keys = np.concatenate(list(k[table[b]]), axis=-1).astype(np.float64)  # [kv, d, slots]
        values = np.concatenate(list(v[table[b]]), axis=-2).astype(np.float64)
        for h in range(heads):
            scores = np.einsum("dt,ds->ts", q[h, :, b], keys[h // group]) * scale
            scores = np.where(mask[b], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[h, :, b] = (probs @ values[h // group]).T
    return out.reshape(heads * d, rows, width)


@pytest.mark.parametrize("isa", ISAS)
# Grouped and plain heads; features and page sizes past whole vectors of 16; one query (a decode
# step), a drafted chunk's few, and the most (`jaxlm.ops.attention.PAGE_BY_PAGE`).
@pytest.mark.parametrize(
    "heads, kv, d, rows, width, size, per_row",
    [
        (9, 3, 64, 1, 1, 128, 2),
        (4, 4, 80, 3, 4, 16, 5),
        (8, 1, 7, 2, 17, 4, 9),
        (6, 2, 128, 5, 1, 7, 6),
    ],
)
@pytest.mark.parametrize("half", [False, True], ids=["float32", "bfloat16"])
def test_attend_equals_numpy(isa, heads, kv, d, rows, width, size, per_row, half):
    rng = np.random.default_rng(heads * width + size)
    q, k, v, table, mask = attention_inputs(rng, heads, kv, d, rows, width, size, per_row, half)
    with kernels.limited_to(isa):
        out = np.asarray(jax.jit(kernels.attend, static_argnums=5)(q, k, v, table, mask, 0.3))
    expected = attention_reference(q, k, v, table, mask, 0.3)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


def test_attend_gives_each_query_the_same_bits_alone_and_on_every_path():
    # A drafted chunk's tokens are those of decoding one at a time only if each of its queries
    # comes out as it would alone (`jaxlm.speculative`).
    rng = np.random.default_rng(0)
    q, k, v, table, mask = attention_inputs(rng, 9, 3, 64, 2, 5, 16, 4, half=False)
    attend = jax.jit(kernels.attend, static_argnums=5)
    chunks = []
    for isa in ISAS:
        with kernels.limited_to(isa):
            chunks.append(np.asarray(attend(q, k, v, table, mask, 0.125)))
            for t in range(5):
                alone = attend(q[..., t : t + 1], k, v, table, mask[:, t : t + 1], 0.125)
                np.testing.assert_array_equal(np.asarray(alone)[..., 0], chunks[-1][..., t])
    for chunk in chunks[1:]:
        np.testing.assert_array_equal(chunk, chunks[0])


def test_attend_reads_no_page_that_no_query_sees():
    # A plan sized for long requests decodes short ones without reading its empty pages: here
    # they hold NaNs, which any product with them would spread.
    rng = np.random.default_rng(2)
    q, k, v, table, mask = attention_inputs(rng, 9, 3, 64, 2, 3, 16, 6, half=False)
    mask[:, :, 3 * 16 :] = False
    unseen = table[:, 3:].reshape(-1)
    expected = attention_reference(q, k, v, table, mask, 0.125)
    k[unseen], v[unseen] = np.nan, np.nan
    out = np.asarray(jax.jit(kernels.attend, static_argnums=5)(q, k, v, table, mask, 0.125))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


def test_a_decode_step_attends_over_the_pages_where_they_lie():
    from jaxlm.ops.attention import attend_paged

    rng = np.random.default_rng(1)
    q, k, v, table, mask = attention_inputs(rng, 9, 3, 64, 2, 1, 16, 4, half=False)
    cache = {"k_pages": jnp.asarray(k), "v_pages": jnp.asarray(v)}
    step = jax.jit(attend_paged).lower(q, cache, table, mask, 64).compile().as_text()
    assert "jaxlm_attend" in step and " gather(" not in step
    out = attend_paged(q, cache, table, mask, 64)
    expected = attention_reference(q, k, v, table, mask, 64**-0.5)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=2e-6)


def test_bad_input_names_the_argument():
    q, scale, x = np.zeros((4, 64), np.int8), np.zeros(4, np.float32), np.zeros((64, 1))
    signs = np.ones(64, np.float32)
    with pytest.raises(ValueError, match="`scale` must be"):
        kernels.w8_matmul(q, scale[:3], x, signs, 64)
    with pytest.raises(ValueError, match="`x` must be"):
        kernels.w8_matmul(q, scale, x[:32], signs, 64)
    with pytest.raises(ValueError, match="`q` must be int8"):
        kernels.w8_matmul(q.astype(np.int16), scale, x, signs, 64)
    with pytest.raises(ValueError, match=r"`signs` must be \[in\] = \[64\]"):
        kernels.w8_matmul(q, scale, x, signs[:32], 64)
    for block in (0, 24, 128):
        with pytest.raises(ValueError, match="`block` must be a power of two dividing in = 64"):
            kernels.w8_matmul(q, scale, x, signs, block)
    packed, scales = int4.quantize(jnp.zeros((4, 64)))
    with pytest.raises(ValueError, match="`scales` must be float16"):
        kernels.w4_matmul(packed, scales.astype(jnp.float32), x)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.w4_matmul(packed[:, :8], scales, x[:16])
    with pytest.raises(ValueError, match="`kind` must be one of `Q4_0`, `Q4_1`"):
        int4.from_gguf(np.zeros(34, np.uint8), gguf.GGMLQuantizationType.Q8_0, (1, 32))
    with pytest.raises(ValueError, match="`name` must be one of"), kernels.limited_to("sse2"):
        pass
    with pytest.raises(ValueError, match=r"`table` must be \[rows, features\]"):
        kernels.rows(np.zeros(8, np.float16), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="`w` must be bfloat16 or float16"):
        kernels.w16_matmul(jnp.zeros((4, 64), jnp.float32), x)
    with pytest.raises(ValueError, match="`x` may have at most 8 columns"):
        kernels.w16_matmul(jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((64, 9)))
    with pytest.raises(ValueError, match="`x` must be"):
        kernels.w16_matmul(jnp.zeros((4, 64), jnp.bfloat16), x[:32])
    q, k, v, table, mask = attention_inputs(np.random.default_rng(0), 4, 2, 8, 1, 1, 4, 2, False)
    for pages in (k[:, :, :4], k[:, :0], np.concatenate([k, k[:, :1]], axis=1)):
        with pytest.raises(ValueError, match="`k_pages` must be"):
            kernels.attend(q, pages, v, table, mask, 1.0)
    with pytest.raises(ValueError, match="`v_pages` must be"):
        kernels.attend(q, k, v[:, :, :2], table, mask, 1.0)
    with pytest.raises(ValueError, match="`k_pages` must be float32 or uint16"):
        kernels.attend(q, k.astype(np.float16), v.astype(np.float16), table, mask, 1.0)
    with pytest.raises(ValueError, match=r"`table` must be \[1, pages per row\]"):
        kernels.attend(q, k, v, table[0], mask, 1.0)
    with pytest.raises(ValueError, match="`mask` must be"):
        kernels.attend(q, k, v, table, mask[..., :4], 1.0)


def custom_calls(fn, *args) -> int:
    # A function of its own: `jax.jit` keeps the traces of a function it has seen.
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text().count("jaxlm_w")


def test_switched_off_products_run_through_xla(monkeypatch):
    rng = np.random.default_rng(0)
    q, scale = jax.jit(ops.quantize_weight)(rng.standard_normal((24, 64), np.float32))
    packed, scales = int4.quantize(rng.standard_normal((24, 64), np.float32))
    x = jnp.asarray(rng.standard_normal((64, 2), np.float32))
    native = [ops.quantized_matmul(q, scale, x), ops.quantized_matmul(packed, scales, x)]
    assert custom_calls(ops.quantized_matmul, q, scale, x) == 1
    # A prompt chunk's many columns: native on the AVX512-VNNI path, which ran them faster
    # than XLA's integer dot; XLA's on the others.
    chunk = jnp.ones((64, 9))
    assert custom_calls(ops.quantized_matmul, q, scale, chunk) == (ISAS[-1] in kernels.ISAS[2:])
    with kernels.limited_to("avx2"):
        assert custom_calls(ops.quantized_matmul, q, scale, chunk) == 0
    assert custom_calls(ops.quantized_matmul, packed, scales, jnp.ones((64, 9))) == 1
    assert kernels.products() == f"native ({ISAS[-1]})"
    monkeypatch.setenv(kernels.SWITCH, "0")
    assert kernels.products() == "XLA"
    assert custom_calls(ops.quantized_matmul, q, scale, x) == 0
    assert custom_calls(ops.quantized_matmul, packed, scales, x) == 0
    # The same rounding of the activations for 8 bits; none for XLA's 4-bit product.
    np.testing.assert_allclose(ops.quantized_matmul(q, scale, x), native[0], rtol=1e-5, atol=1e-5)
    exact = np.asarray(int4.dequantize(packed, scales)) @ np.asarray(x)
    np.testing.assert_allclose(ops.quantized_matmul(packed, scales, x), exact, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(native[1], exact, rtol=0.05, atol=0.05 * np.abs(exact).max())


def test_a_product_loads_the_library_itself(tmp_path):
    # A process whose first use of the kernels is a product (`available()` not asked first).
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, (40, 72), dtype=np.int8)
    scale, x = rng.random(40, np.float32), rng.standard_normal((72, 3), np.float32)
    signs = rng.choice(np.float32([-1, 1]), 72)
    np.savez(tmp_path / "in.npz", q=q, scale=scale, x=x, signs=signs)
    code = (
        "import sys, numpy as np\n"
        "from jaxlm import kernels\n"
        "a = np.load(sys.argv[1])\n"
        "y = kernels.w8_matmul(a['q'], a['scale'], a['x'], a['signs'], 8)\n"
        "np.save(sys.argv[2], np.asarray(y))"
    )
    out = tmp_path / "out.npy"
    subprocess.run([sys.executable, "-c", code, tmp_path / "in.npz", out], check=True)
    np.testing.assert_array_equal(np.load(out), w8_reference(q, scale, x, signs, 8))


def test_a_missing_library_is_reported_once(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    load = kernels._library.__wrapped__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load() is None
    assert [str(w.message) for w in caught] == [
        "jaxlm: native CPU kernels unavailable (the library was not built at install); "
        "quantized products and rows of tied 16-bit embeddings run through XLA"
    ]


def test_kernels_benchmark_runs_every_variant(monkeypatch, capsys):
    # The benchmark switches the kernels with the environment; monkeypatch restores it.
    monkeypatch.setenv(kernels.SWITCH, "1")
    bench = load_benchmark("native_products")
    args = ["--layers", "1", "--vocab", "1024", "--cols", "1,3", "--steps", "1", "--repeats", "1"]
    assert bench.main([*args, "--isa", "portable"]) == 0
    out = capsys.readouterr().out
    assert all(f"{variant} " in out for variant in bench.VARIANTS), out
    assert "native kernels: portable" in out
    assert kernels.isa() == kernels.cpu_isas()[-1]


def test_attention_benchmark_runs_every_case(monkeypatch, capsys):
    monkeypatch.setenv(kernels.SWITCH, "1")
    bench = load_benchmark("attention")
    assert bench.main(["--layers", "1", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(bench.CASES), lines
    assert kernels.available()


def test_cpp_sources_are_formatted():
    # Google's style (`csrc/.clang-format`), checked by the `clang-format` of the test extra.
    sources = sorted(str(p) for p in CSRC.iterdir() if p.suffix in (".cc", ".h"))
    result = subprocess.run(
        [clang_format.get_executable("clang-format"), "--dry-run", "--Werror", *sources],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
