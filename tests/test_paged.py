"""The paged forward: rows of prompt chunks and decode tokens over a paged KV cache, against
transformers on each sequence alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model
from flax import nnx

# The fixture of `tests/test_families.py`: a tiny saved model of each family beyond Llama.
from test_families import family as family

import jaxlm
from jaxlm import ops
from jaxlm.memory import Layout, declarations

# Tables of 5 pages of 4 slots: attention reads 2, 4 or 5 of them as the rows fill.
pytestmark = pytest.mark.usefixtures("small_buckets")

PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 4, 5, 24
LENGTHS = [13, 7, 17]
# Each call's tokens per row: rows prefill in chunks, decode one token, or sit out (0).
SCHEDULE = [[5, 1, 8], [8, 5, 1], [0, 1, 8]]


def paged_cache(model) -> dict:
    # The pages the attention layers declare, laid out as an engine's plan lays them out.
    dims = {"num_pages": NUM_PAGES, "page_size": PAGE_SIZE}
    return Layout.build(list(declarations(model)), dims, ops.storage_dtype).allocate()


def assert_paged_rows_equal_each_sequence_alone(model, hf):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.config.vocab_size, n) for n in LENGTHS]
    # Each row's pages, scattered over the cache; page 0 pads and belongs to no row.
    table = rng.permutation(np.arange(1, NUM_PAGES))[: len(LENGTHS) * PAGES_PER_SEQ]
    table = jnp.asarray(table.reshape(len(LENGTHS), PAGES_PER_SEQ), jnp.int32)
    graphdef, state = nnx.split(model)
    step = jax.jit(
        lambda state, *args: nnx.merge(graphdef, state).forward_paged(*args), donate_argnums=2
    )
    cache = paged_cache(model)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)]
    done = [0] * len(LENGTHS)
    got = [[] for _ in LENGTHS]
    for counts in SCHEDULE:
        # Rows of one token (or none) in one group, rows of prompt chunks in another.
        split = [
            [r for r, n in enumerate(counts) if n <= 1],
            [r for r, n in enumerate(counts) if n > 1],
        ]
        groups = []
        for rows in split:
            width = max(counts[r] for r in rows)
            ids = np.zeros((len(rows), width), np.int32)
            positions = np.full((len(rows), width), -1, np.int32)
            for i, r in enumerate(rows):
                ids[i, : counts[r]] = seqs[r][done[r] : done[r] + counts[r]]
                positions[i, : counts[r]] = np.arange(done[r], done[r] + counts[r])
            groups.append(dict(input_ids=ids, positions=positions, table=table[np.array(rows)]))
        logits, cache = step(state, groups, cache)
        for rows, group_logits in zip(split, logits, strict=True):
            for i, r in enumerate(rows):
                got[r].extend(np.asarray(group_logits[i, : counts[r]]))
        done = [d + n for d, n in zip(done, counts, strict=True)]
    assert done == LENGTHS
    # The pages were updated in place.
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)] == pointers
    for r, seq in enumerate(seqs):
        with torch.no_grad():
            expected = hf(torch.tensor(seq[None])).logits[0].numpy()
        np.testing.assert_allclose(np.stack(got[r]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama_gqa4", "mistral_window", "qwen3"])
def test_paged_rows_equal_each_sequence_alone(tmp_path, name):
    hf = make_hf_model(tmp_path, name)
    model, _ = jaxlm.load(tmp_path)
    assert_paged_rows_equal_each_sequence_alone(model, hf)


def test_every_family_runs_paged(family):
    # `family` is `tests/test_families.py`'s fixture: a tiny model of each other family.
    _, path, hf = family
    model, _ = jaxlm.load(path)
    assert_paged_rows_equal_each_sequence_alone(model, hf)


@pytest.mark.parametrize("queries", [ops.attention.PAGE_BY_PAGE, 128])
def test_attention_over_pages_equals_numpy(queries):
    # 9 heads over 3 KV heads, 16 pages of 16 slots, the first 200 filled, causal for the last
    # `queries` of them. A drafted chunk multiplies page by page, as decoding does; a prompt's
    # wider chunk lays the pages end to end first: its queries against 16 small pages were 16
    # small products each (`docs/performance.md`, "Attention over the filled slots").
    rng = np.random.default_rng(0)
    heads, kv, d, pages, size, filled = 9, 3, 64, 16, 16, 200
    q = rng.standard_normal((heads, d, 1, queries), np.float32)
    k = rng.standard_normal((1, pages, kv, d, size), np.float32)
    v = rng.standard_normal((1, pages, kv, size, d), np.float32)
    slot = np.arange(pages * size)
    position = filled - queries + np.arange(queries)
    mask = (slot[None, :] <= position[:, None])[None]
    out = np.asarray(ops.attention.attend(*map(jnp.asarray, (q, k, v, mask))))
    # NumPy, each query head against its KV head's slots laid end to end.
    keys = k[0].transpose(1, 2, 0, 3).reshape(kv, d, -1)
    values = v[0].transpose(1, 0, 2, 3).reshape(kv, -1, d)
    expected = np.empty((heads, d, queries), np.float32)
    for h in range(heads):
        scores = q[h, :, 0].T @ keys[h // 3] / np.sqrt(d)
        scores = np.where(mask[0], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        expected[h] = (probs @ values[h // 3]).T
    np.testing.assert_allclose(out.reshape(heads, d, queries), expected, rtol=1e-4, atol=1e-5)
    dots = [
        e.outvars[0].aval.shape
        for e in jax.make_jaxpr(ops.attention.attend)(q, k, v, mask).eqns
        if e.primitive.name == "dot_general"
    ]
    grouped = 3 * queries
    if queries > ops.attention.PAGE_BY_PAGE:
        assert dots == [(1, 1, kv, grouped, pages * size), (1, 1, kv, grouped, d)]
    else:
        assert dots == [(1, pages, kv, grouped, size), (1, pages, kv, grouped, d)]
