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
