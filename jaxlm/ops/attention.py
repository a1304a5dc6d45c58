"""The paged KV cache: its layout, reads and writes, and attention over it (see `jaxlm.ops`).

Every cached forward, `generate`'s and the serving engine's, writes its keys and values to
pages (`paged_kv_specs`) and reads a row's pages back in the layouts `attend` takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import kernels
from jaxlm.memory import ScratchSpec
from jaxlm.ops.backend import platform

_MASKED = -1e30


# The KV cache.


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a scratch slot of `dtype` is stored in.

    XLA:CPU rewrites a bfloat16 `dynamic_update_slice` into a convert of the whole buffer to
    float32 and back; the same bits stored as uint16 update in place (see
    `docs/performance.md`, "bfloat16 caches as uint16"). `write_cache` and `read_cache`
    convert at the edges, bit-exactly.
    """
    if platform() == "cpu" and dtype == jnp.bfloat16:
        return np.dtype(np.uint16)
    return np.dtype(dtype)


def _as_stored(new: jax.Array, buf: jax.Array) -> jax.Array:
    """`new` in `buf`'s storage dtype (bfloat16 as its uint16 bits)."""
    if buf.dtype == jnp.uint16:
        new = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), jnp.uint16)
    return new.astype(buf.dtype)


def write_cache(buf: jax.Array, new: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """Write `new` into `buf` at `index` along `axis` (in place when `buf` is donated)."""
    start = [0] * buf.ndim
    start[axis] = index
    return jax.lax.dynamic_update_slice(buf, _as_stored(new, buf), start)


def read_cache(buf: jax.Array) -> jax.Array:
    """The cache values of `buf`, undoing the uint16 storage of bfloat16."""
    if buf.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(buf, jnp.bfloat16)
    return buf


def to_cache_layout(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values `[kv_heads, head_dim, B, T]` as `attend` takes them, one page per row:
    keys `[B, 1, kv_heads, head_dim, T]` and values `[B, 1, kv_heads, T, head_dim]`, where
    both attention products are plain batched matmuls (see `docs/performance.md`, "KV cache
    layout")."""
    return k.transpose(2, 0, 1, 3)[:, None], v.transpose(2, 0, 3, 1)[:, None]


def paged_kv_specs(num_kv_heads: int, head_dim: int, dtype) -> tuple[ScratchSpec, ScratchSpec]:
    """The declared paged K and V caches of one attention layer: keys `[num_pages, kv_heads,
    head_dim, page_size]` and values `[num_pages, kv_heads, page_size, head_dim]`, so that a
    sequence's pages gathered in order are `attend`'s layouts. On a mesh the pages
    split by KV head over `model`, and where rows own their pages, with their rows over `data`
    (`jaxlm.sharding.Partitioner`)."""
    axes = ("pages", "kv_heads", None, None)
    return (
        ScratchSpec(
            ("num_pages", num_kv_heads, head_dim, "page_size"), dtype, axes=axes, doc="key pages"
        ),
        ScratchSpec(
            ("num_pages", num_kv_heads, "page_size", head_dim), dtype, axes=axes, doc="value pages"
        ),
    )


def write_paged(cache: dict, groups) -> dict:
    """`cache`'s `k_pages` and `v_pages` with the keys and values of every group of `groups`
    written, in one update each (in place when `cache` is donated).

    A group is `(k, v, slots)`: the keys `[R, 1, kv_heads, D, C]` and values `[R, 1, kv_heads,
    C, D]` of `R` rows of `C` tokens (`to_cache_layout`'s) and their slots `[R, C]`, each `page *
    page_size + offset`; a slot past the last page (padding) is not written. Two updates of a
    page array in one step made XLA copy it whole."""
    k_pages, v_pages = cache["k_pages"], cache["v_pages"]
    kv, d, size = k_pages.shape[1:]
    ks, vs, slots = [], [], []
    for k, v, where in groups:
        rows, cols = where.shape
        ks.append(k.reshape(rows, kv, d, cols).transpose(0, 3, 1, 2).reshape(-1, kv, d))
        vs.append(v.reshape(rows, kv, cols, d).transpose(0, 2, 1, 3).reshape(-1, kv, d))
        slots.append(where.reshape(-1))
    k, v, slots = (jnp.concatenate(a) for a in (ks, vs, slots))  # [N, kv, D], [N]
    page, offset = slots // size, slots % size
    return {
        "k_pages": k_pages.at[page, :, :, offset].set(_as_stored(k, k_pages), mode="drop"),
        "v_pages": v_pages.at[page, :, offset, :].set(_as_stored(v, v_pages), mode="drop"),
    }


def gather_pages(cache: dict, table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The keys `[R, P, kv_heads, D, page_size]` and values `[R, P, kv_heads, page_size, D]`
    of the `P` pages that `table` `[R, P]` lists for each row, in order, as `attend` takes
    them: the pages as they lie, without laying a row's slots end to end."""
    return read_cache(cache["k_pages"][table]), read_cache(cache["v_pages"][table])


# Attention.


# The most queries a row attends with over the pages as they lie: a drafted chunk's (at most
# `jaxlm.speculative.MAX_DRAFT` drafts and the last token), whose logits then equal decoding's
# bit for bit. A wider chunk (a prompt's) lays the pages end to end first.
PAGE_BY_PAGE = 17


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Scaled dot-product attention of queries `q` `[heads, D, B, T]` over keys `k` `[B, P,
    kv_heads, D, S]` and values `v` `[B, P, kv_heads, S, D]` (each row's `P` pages of `S` slots,
    the cache layouts) where `mask` `[B, T, P * S]` holds; returns the heads' outputs `[heads *
    D, B, T]`.

    The pages are a batch dimension of both products and the softmax spans them: gathering a
    row's pages end to end cost a transposing copy of its keys and values in every layer, about
    twice the time of the attention itself in a batch-1 decode step (56 against 15-20 us a
    layer; see `docs/performance.md`, "KV cache layout"). A chunk of more than `PAGE_BY_PAGE`
    queries (a prompt's) pays that copy: its products page by page were many small ones.

    The scores are scaled by `scale` (`D ** -0.5` without it) and, with `softcap`, capped to
    `softcap * tanh(scores / softcap)` (Gemma 2).

    A chunk of several tokens multiplies in the cache's dtype (bfloat16 runs natively on CPUs
    with bf16 instructions); one token converts the cache to float32, whose products ran faster
    there (see `docs/performance.md`, "Attention products' dtype").
    """
    heads, d, b, t = q.shape
    if t > PAGE_BY_PAGE and k.shape[1] > 1:
        # A prompt chunk: its queries against every page would be many small products.
        k = k.transpose(0, 2, 3, 1, 4).reshape(b, 1, k.shape[2], d, -1)
        v = v.transpose(0, 2, 1, 3, 4).reshape(b, 1, v.shape[2], -1, d)
    pages, nkv, size = k.shape[1], k.shape[2], k.shape[4]
    g = heads // nkv
    q = q.reshape(nkv, g, d, b, t).transpose(3, 0, 1, 4, 2).reshape(b, 1, nkv, g * t, d)
    q = jnp.broadcast_to(q, (b, pages, nkv, g * t, d))
    dtype = k.dtype if t > 1 else jnp.float32
    f32 = jnp.float32
    scores = jnp.einsum("bpnqd,bpnds->bpnqs", q.astype(dtype), k, preferred_element_type=f32)
    scores = scores * _score_scale(d, scale)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = mask.reshape(b, t, pages, size).transpose(0, 2, 1, 3)[:, :, None, None]
    mask = jnp.broadcast_to(mask, (b, pages, nkv, g, t, size)).reshape(scores.shape)
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=(1, 4)).astype(dtype)
    out = jnp.einsum("bpnqs,bpnsd->bpnqd", probs, v.astype(dtype), preferred_element_type=f32)
    out = out.sum(axis=1).reshape(b, nkv, g, t, d)
    return out.transpose(1, 2, 4, 0, 3).reshape(heads * d, b, t)


# The fewest slots of a row's pages that `attend_paged` reads.
FILLED_BUCKET = 256


def _score_scale(d: int, scale: float | None) -> float:
    """What `attend` scales the scores by: `scale`, or `D ** -0.5` without it."""
    return d**-0.5 if scale is None else scale


def _smaller_buckets(total: int, first: int) -> list[int]:
    # `first` doubling, below `total`.
    return [n for n in (first << i for i in range(total.bit_length())) if n < total]


def _smallest_that_holds(end, sizes, unit, branch, *operands):
    # `branch(size, *operands)` for the smallest of `sizes` whose `size * unit` slots hold the
    # first `end`, picked at run time.
    if len(sizes) == 1:
        return branch(sizes[0], *operands)
    index = jnp.searchsorted(jnp.asarray(sizes) * unit, end)
    branches = [functools.partial(branch, size) for size in sizes]
    return jax.lax.switch(index, branches, *operands)


def attend_paged(q, cache, table, mask, end, **options):
    """`attend` over the pages that `table` `[R, pages_per_seq]` lists, reading only the first
    of them: the fewest (those holding 256 slots, doubling up to the whole row) that hold the
    `end` slots in use. `options` are `attend`'s `scale` and `softcap`.

    Slots from `end` on are masked for every query, so leaving them out changes nothing but the
    work: a plan sized for long requests (`jaxlm serve` allows 4096 tokens) would otherwise
    gather every page of every row at each step (see `docs/performance.md`, "Attention over
    the filled slots").

    On one CPU device, up to `PAGE_BY_PAGE` queries a row without `softcap` run as one native
    call (`jaxlm.kernels.attend`) over the pages where they lie, skipping those no query sees:
    XLA copies them out and runs a dozen small operations a layer (`docs/performance.md`,
    "Attention as one native call").
    """
    k_pages, v_pages = cache["k_pages"], cache["v_pages"]
    if (
        q.shape[-1] <= PAGE_BY_PAGE
        and options.get("softcap") is None
        and k_pages.dtype in (jnp.float32, jnp.uint16)
        and kernels.runs_here()
    ):
        scale = _score_scale(q.shape[1], options.get("scale"))
        return kernels.attend(q, k_pages, v_pages, table, mask, scale)
    per_seq, size = table.shape[1], k_pages.shape[-1]
    counts = [*_smaller_buckets(per_seq, -(-FILLED_BUCKET // size)), per_seq]

    def branch(count, q, cache, table, mask):
        k, v = gather_pages(cache, table[:, :count])
        return attend(q, k, v, mask[..., : count * size], **options)

    return _smallest_that_holds(end, counts, size, branch, q, cache, table, mask)
