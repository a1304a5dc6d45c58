"""Tests of jaxlm.sampling: hand-made logits, transformers references and statistics."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import jaxlm.sampling
from jaxlm.sampling import (
    HEAD_SIZE,
    apply_repetition_penalty,
    filter_logits,
    first_argmax,
    min_p_mask,
    sample,
    top_k_mask,
    top_p_mask,
)

try:
    from scipy.stats import chi2
except ImportError:
    chi2 = None

# scipy.stats.chi2.ppf(0.999, df), used when scipy is not installed.
CHI2_999 = {
    1: 10.8276,
    2: 13.8155,
    3: 16.2662,
    4: 18.4668,
    5: 20.5150,
    6: 22.4577,
    7: 24.3219,
    8: 26.1245,
    9: 27.8772,
    10: 29.5883,
    11: 31.2641,
}


def chi2_999(df):
    return float(chi2.ppf(0.999, df)) if chi2 is not None else CHI2_999[df]


def kept(masked):
    """The kept token ids of each row, as sets."""
    return [set(np.flatnonzero(row).tolist()) for row in np.isfinite(np.asarray(masked))]


def keys_for(seed, n):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def params(B, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Per-row sampling arrays from scalars or sequences."""
    return dict(
        temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)),
        top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (B,)),
        top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (B,)),
        min_p=jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), (B,)),
    )


def random_logits(seed, B, V):
    return np.random.default_rng(seed).normal(scale=3.0, size=(B, V)).astype(np.float32)


def test_docstring_examples():
    result = doctest.testmod(jaxlm.sampling, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


# Top-k.


def test_top_k_keeps_ties_and_off_values():
    ks = [2, 1, 3, 4, 0, -1, 10]
    logits = jnp.tile(jnp.array([[3.0, 1.0, 1.0, 0.0]]), (len(ks), 1))
    out = top_k_mask(logits, jnp.array(ks, jnp.int32))
    assert kept(out) == [{0, 1, 2}, {0}, {0, 1, 2}, {0, 1, 2, 3}] + [{0, 1, 2, 3}] * 3
    np.testing.assert_array_equal(
        np.where(np.isfinite(out), out, 0), np.where(np.isfinite(out), logits, 0)
    )


def test_top_k_per_row_and_off_is_identity():
    logits = jnp.array(
        [
            [0.0, 5.0, 2.0, 5.0, -1.0, 2.0],
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            [-jnp.inf, 1.0, 1.0, 1.0, 0.0, -2.0],
        ]
    )
    assert kept(top_k_mask(logits, jnp.array([1, 3, 2]))) == [{1, 3}, {3, 4, 5}, {1, 2, 3}]
    off = top_k_mask(logits, jnp.array([0, 6, -3]))
    np.testing.assert_array_equal(off, logits)


def test_top_k_matches_transformers():
    logits = random_logits(0, 12, 50)
    ks = np.array([1, 2, 3, 5, 7, 10, 20, 33, 49, 50, 4, 8], np.int32)
    ours = top_k_mask(jnp.asarray(logits), jnp.asarray(ks))
    for i, k in enumerate(ks):
        hf = TopKLogitsWarper(int(k))(None, torch.from_numpy(logits[i : i + 1]).clone())
        np.testing.assert_array_equal(ours[i], hf.numpy()[0])


# Top-p.


def test_top_p_hand_made_with_ties():
    probs = [0.5, 0.2, 0.2, 0.1]
    ps = [0.4, 0.6, 0.75, 0.95, 1.0]
    logits = jnp.log(jnp.array([probs] * len(ps)))
    out = top_p_mask(logits, jnp.array(ps))
    # p=0.6 needs {0, 1}; token 2 is tied with token 1, so it is kept too.
    assert kept(out) == [{0}, {0, 1, 2}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}]


def test_top_p_per_row_and_edge_cases():
    logits = jnp.log(
        jnp.array(
            [
                [0.25, 0.25, 0.25, 0.25],  # All tied: any p keeps all.
                [0.1, 0.6, 0.3, 1e-9],
                [0.1, 0.6, 0.3, 1e-9],
                [0.97, 0.01, 0.01, 0.01],  # A tiny p keeps at least the top token.
            ]
        )
    )
    out = top_p_mask(logits, jnp.array([0.1, 0.7, 0.95, 1e-6]))
    assert kept(out) == [{0, 1, 2, 3}, {1, 2}, {0, 1, 2}, {0}]
    np.testing.assert_array_equal(top_p_mask(logits, jnp.ones(4)), logits)


def test_top_p_matches_transformers():
    logits = random_logits(1, 16, 40)
    ps = np.linspace(0.05, 0.99, 16).astype(np.float32)
    ours = top_p_mask(jnp.asarray(logits), jnp.asarray(ps))
    for i, p in enumerate(ps):
        hf = TopPLogitsWarper(float(p))(None, torch.from_numpy(logits[i : i + 1]).clone())
        np.testing.assert_array_equal(ours[i], hf.numpy()[0])


def test_top_k_and_top_p_match_a_float64_reference_with_many_ties():
    rng = np.random.default_rng(2)
    B, V = 64, 12
    logits = rng.integers(0, 4, size=(B, V)).astype(np.float32)
    ks = rng.integers(-1, V + 2, size=B).astype(np.int32)
    ps = rng.uniform(0.01, 1.0, size=B).astype(np.float32)
    got_k = kept(top_k_mask(jnp.asarray(logits), jnp.asarray(ks)))
    got_p = kept(top_p_mask(jnp.asarray(logits), jnp.asarray(ps)))
    for i in range(B):
        row = logits[i].astype(np.float64)
        desc = np.sort(row)[::-1]
        k = ks[i]
        want_k = set(range(V)) if k <= 0 or k >= V else set(np.flatnonzero(row >= desc[k - 1]))
        assert got_k[i] == want_k
        probs = np.exp(desc - desc[0]) / np.exp(desc - desc[0]).sum()
        n = int(np.searchsorted(np.cumsum(probs), ps[i])) + 1  # First prefix reaching p.
        assert got_p[i] == set(np.flatnonzero(row >= desc[min(n, V) - 1]))


def test_large_vocab_head_and_full_sort_paths_match_transformers():
    # Rows whose k or nucleus reaches past HEAD_SIZE need the full sort; the others do not.
    V = 4 * HEAD_SIZE
    rng = np.random.default_rng(12)
    scales = np.array([3.0, 3.0, 3.0, 0.05, 0.05, 3.0], np.float32)
    logits = (rng.normal(size=(6, V)) * scales[:, None]).astype(np.float32)
    ks = np.array([5, 0, 2 * HEAD_SIZE, 0, 300, 40], np.int32)
    ps = np.array([1.0, 0.9, 1.0, 0.95, 0.5, 0.8], np.float32)
    ours = filter_logits(
        jnp.asarray(logits), jnp.ones(6), jnp.asarray(ks), jnp.asarray(ps), jnp.zeros(6)
    )
    for i in range(6):
        scores = torch.from_numpy(logits[i : i + 1]).clone()
        if ks[i] > 0:
            scores = TopKLogitsWarper(int(ks[i]))(None, scores)
        if ps[i] < 1.0:
            scores = TopPLogitsWarper(float(ps[i]))(None, scores)
        np.testing.assert_array_equal(ours[i], scores.numpy()[0])
    sizes = [len(s) for s in kept(ours)]
    assert sizes[2] > HEAD_SIZE and sizes[3] > HEAD_SIZE
    assert sizes[0] == 5 and sizes[5] <= 40


def test_ties_straddling_the_head_are_all_kept():
    V = 2 * HEAD_SIZE
    row = np.zeros(V, np.float32)
    row[:HEAD_SIZE] = 5.0  # The head ends inside the second group of tied logits.
    row[HEAD_SIZE : HEAD_SIZE + 100] = 4.0
    logits = jnp.asarray(np.tile(row, (4, 1)))
    top = set(range(HEAD_SIZE))
    two_groups = set(range(HEAD_SIZE + 100))
    assert kept(top_k_mask(logits, jnp.array([HEAD_SIZE, HEAD_SIZE + 1, 1, 0]))) == [
        top,
        two_groups,
        top,
        set(range(V)),
    ]
    weights = np.array([HEAD_SIZE * np.exp(5.0), 100 * np.exp(4.0), V - HEAD_SIZE - 100])
    mass_5, mass_4 = weights[:2] / weights.sum()
    ps = jnp.array([mass_5 - 0.01, mass_5 + 0.01, mass_5 + mass_4 + 0.001, 1.0], jnp.float32)
    assert kept(top_p_mask(logits, ps)) == [top, two_groups, set(range(V)), set(range(V))]


# Min-p.


def test_min_p_hand_made_per_row():
    probs = [0.5, 0.25, 0.2, 0.05]
    min_ps = [0.45, 0.2, 0.0, 1.0, 0.6]
    logits = jnp.log(jnp.array([probs] * len(min_ps)))
    out = min_p_mask(logits, jnp.array(min_ps))
    assert kept(out) == [{0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0}, {0}]
    np.testing.assert_array_equal(min_p_mask(logits, jnp.zeros(5)), logits)


def test_min_p_keeps_tied_top_tokens():
    logits = jnp.array([[2.0, 2.0, 1.0, -jnp.inf]])
    assert kept(min_p_mask(logits, jnp.array([1.0]))) == [{0, 1}]


def test_min_p_matches_transformers():
    logits = random_logits(3, 12, 40)
    min_ps = np.linspace(0.01, 0.9, 12).astype(np.float32)
    ours = min_p_mask(jnp.asarray(logits), jnp.asarray(min_ps))
    for i, m in enumerate(min_ps):
        hf = MinPLogitsWarper(float(m))(None, torch.from_numpy(logits[i : i + 1]).clone())
        np.testing.assert_array_equal(ours[i], hf.numpy()[0])


# Repetition penalty.


def test_repetition_penalty_hand_made():
    logits = jnp.array(
        [
            [2.0, -2.0, 0.5, -0.5, 1.0, 3.0, 0.0],
            [2.0, -2.0, 0.5, -0.5, 1.0, 3.0, 0.0],
        ]
    )
    token_ids = jnp.array([[0, 1, 1, 3, 1, 4, 6], [0, 1, 1, 3, 1, 4, 6]], jnp.int32)
    valid = jnp.array([[True, True, True, True, True, False, True]] * 2)
    out = apply_repetition_penalty(logits, token_ids, valid, jnp.array([2.0, 1.0]))
    # Token 1 is seen three times and penalized once; token 4 is only seen in an invalid entry.
    np.testing.assert_array_equal(out[0], [1.0, -4.0, 0.5, -1.0, 1.0, 3.0, 0.0])
    np.testing.assert_array_equal(out[1], logits[1])


def test_repetition_penalty_changes_only_seen_tokens():
    rng = np.random.default_rng(4)
    B, V, L = 4, 30, 12
    logits = random_logits(4, B, V)
    token_ids = rng.integers(0, V, size=(B, L)).astype(np.int32)
    valid = rng.random((B, L)) < 0.7
    out = np.asarray(
        apply_repetition_penalty(
            jnp.asarray(logits), jnp.asarray(token_ids), jnp.asarray(valid), jnp.full(B, 1.3)
        )
    )
    for i in range(B):
        seen = set(token_ids[i][valid[i]].tolist())
        unseen = [v for v in range(V) if v not in seen]
        np.testing.assert_array_equal(out[i, unseen], logits[i, unseen])
        for v in seen:
            # Positive logits shrink towards 0 and negative ones grow away from it.
            assert out[i, v] < logits[i, v]
            assert np.sign(out[i, v]) == np.sign(logits[i, v])


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(5)
    B, V, L = 6, 40, 25
    logits = random_logits(5, B, V)
    token_ids = rng.integers(0, V, size=(B, L)).astype(np.int64)
    penalties = np.array([1.0, 1.1, 1.5, 2.0, 0.8, 3.7], np.float32)
    ours = apply_repetition_penalty(
        jnp.asarray(logits),
        jnp.asarray(token_ids, jnp.int32),
        jnp.ones((B, L), bool),
        jnp.asarray(penalties),
    )
    for i, pen in enumerate(penalties):
        hf = RepetitionPenaltyLogitsProcessor(float(pen))(
            torch.from_numpy(token_ids[i : i + 1]), torch.from_numpy(logits[i : i + 1]).clone()
        )
        np.testing.assert_array_equal(ours[i], hf.numpy()[0])


# Composition of the filters.


def test_filter_logits_is_the_composition_of_the_masks():
    rng = np.random.default_rng(6)
    B, V = 32, 16
    logits = jnp.asarray(rng.integers(-3, 3, size=(B, V)).astype(np.float32))
    p = params(
        B,
        temperature=rng.uniform(0.3, 2.0, B),
        top_k=rng.integers(-1, V + 1, B),
        top_p=np.where(rng.random(B) < 0.3, 1.0, rng.uniform(0.05, 1.0, B)),
        min_p=np.where(rng.random(B) < 0.3, 0.0, rng.uniform(0.0, 0.5, B)),
    )
    # A same-shape divisor keeps XLA from dividing by multiplying with the reciprocal.
    want = logits / jnp.broadcast_to(p["temperature"][:, None], (B, V))
    want = min_p_mask(top_p_mask(top_k_mask(want, p["top_k"]), p["top_p"]), p["min_p"])
    np.testing.assert_array_equal(filter_logits(logits, **p), want)


def test_filter_logits_matches_the_transformers_warpers():
    B, V = 8, 40
    logits = random_logits(11, B, V)
    rng = np.random.default_rng(11)
    t = rng.uniform(0.3, 2.0, B).astype(np.float32)
    k = rng.integers(2, V, B).astype(np.int32)
    top_p = rng.uniform(0.3, 0.99, B).astype(np.float32)
    min_p = rng.uniform(0.01, 0.2, B).astype(np.float32)
    ours = filter_logits(jnp.asarray(logits), *map(jnp.asarray, (t, k, top_p, min_p)))
    for i in range(B):
        scores = torch.from_numpy(logits[i : i + 1]).clone()
        for warper in (
            TemperatureLogitsWarper(float(t[i])),
            TopKLogitsWarper(int(k[i])),
            TopPLogitsWarper(float(top_p[i])),
            MinPLogitsWarper(float(min_p[i])),
        ):
            scores = warper(None, scores)
        np.testing.assert_array_equal(ours[i], scores.numpy()[0])


# Sampling.

# One compiled sampler per shape keeps the tests quick; eager calls retrace the conditionals.
jit_sample = jax.jit(sample)


@pytest.mark.parametrize(
    ("settings", "V"),
    [
        (dict(temperature=0.7), 8),
        (dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.02), 10),
    ],
)
def test_sample_matches_the_warped_softmax(settings, V):
    N = 20000
    logits = np.random.default_rng(7).normal(size=V).astype(np.float32)
    # The reference distribution comes from transformers' warpers applied in its order.
    scores = torch.from_numpy(logits[None]).clone()
    scores = TemperatureLogitsWarper(settings["temperature"])(None, scores)
    if "top_k" in settings:
        scores = TopKLogitsWarper(settings["top_k"])(None, scores)
        scores = TopPLogitsWarper(settings["top_p"])(None, scores)
        scores = MinPLogitsWarper(settings["min_p"])(None, scores)
    expected = torch.softmax(scores.double(), dim=-1).numpy()[0]
    support = expected > 0

    tokens = jit_sample(
        jnp.tile(jnp.asarray(logits), (N, 1)), keys_for(0, N), **params(N, **settings)
    )
    counts = np.bincount(np.asarray(tokens), minlength=V)
    assert counts[~support].sum() == 0
    e = expected[support] * N
    stat = float((((counts[support] - e) ** 2) / e).sum())
    assert stat < chi2_999(int(support.sum()) - 1), (stat, counts, expected * N)


def test_sample_is_deterministic_for_fixed_keys():
    B, V = 64, 20
    logits = jnp.asarray(random_logits(8, B, V))
    p = params(B, temperature=1.0, top_k=10, top_p=0.9)
    first = jit_sample(logits, keys_for(1, B), **p)
    np.testing.assert_array_equal(first, jit_sample(logits, keys_for(1, B), **p))
    assert not np.array_equal(first, jit_sample(logits, keys_for(2, B), **p))


def test_greedy_rows_take_the_raw_argmax_whatever_the_settings():
    logits = jnp.array(
        [
            [0.0, 3.0, 3.0, 1.0],  # Tie: the first index wins.
            [5.0, 4.9, 4.8, 0.0],
            [0.0, 1.0, 2.0, 9.0],
            [1.0, 1.0, 1.0, 1.0],
        ]
    )
    mixed = params(
        4,
        temperature=[0.0, 0.0, 2.0, 0.0],
        top_k=[1, 2, 3, 0],
        top_p=[0.01, 0.5, 0.3, 1.0],
        min_p=[0.9, 0.0, 0.5, 0.0],
    )
    for seed in range(5):
        out = np.asarray(jit_sample(logits, keys_for(seed, 4), **mixed))
        assert out[[0, 1, 3]].tolist() == [1, 0, 0]
    all_greedy = params(4, temperature=0.0, top_k=2, top_p=0.5, min_p=0.5)
    np.testing.assert_array_equal(jit_sample(logits, keys_for(0, 4), **all_greedy), [1, 0, 3, 0])


@pytest.mark.parametrize("V", [24, 2 * HEAD_SIZE])
def test_a_row_draws_the_same_alone_or_in_a_batch(V):
    # With the large vocabulary, row 4's nucleus needs the full sort and the others do not.
    logits = random_logits(9, 6, V)
    logits[4] *= 0.01
    p = params(
        6,
        temperature=[1.0, 0.8, 1.5, 0.0, 1.0, 0.9],
        top_k=[0, 3, 0, 5, 0, 40],
        top_p=[1.0, 1.0, 0.7, 0.2, 0.95, 0.9],
        min_p=[0.0, 0.1, 0.0, 0.0, 0.0, 0.05],
    )
    jit_filter = jax.jit(filter_logits)
    filtered = jit_filter(jnp.asarray(logits), *p.values())
    for seed in range(3):
        keys = keys_for(seed, 6)
        batch = np.asarray(jit_sample(jnp.asarray(logits), keys, **p))
        for i in range(6):
            row = {n: a[i : i + 1] for n, a in p.items()}
            alone = jit_sample(jnp.asarray(logits[i : i + 1]), keys[i : i + 1], **row)
            assert int(alone[0]) == batch[i]
            if seed == 0:
                alone = jit_filter(jnp.asarray(logits[i : i + 1]), *row.values())
                np.testing.assert_array_equal(alone[0], filtered[i])
    if V > HEAD_SIZE:
        assert len(kept(filtered[4:5])[0]) > HEAD_SIZE


def test_first_argmax_is_numpys_argmax():
    # numpy's argmax, like `jnp.argmax`, returns the first index of the maximum, or of the first
    # NaN; rows of ties (logits rounded to a few values), infinities and NaNs.
    rng = np.random.default_rng(0)
    logits = np.round(rng.standard_normal((12, 49152)), 1).astype(np.float32)
    logits[1, [7, 30000]] = np.inf
    logits[2] = -np.inf
    logits[3, [5, 40000]] = np.nan
    logits[4, 49151] = 100.0
    logits[5, 0] = np.nan
    logits[6] = 1.0
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(logits)))
    assert got.dtype == np.int32
    assert got.tolist() == np.argmax(logits, axis=-1).tolist()
    assert got[:7].tolist() == [got[0], 7, 0, 5, 49151, 0, 0]


def test_nan_rows_return_their_first_nan_index():
    logits = jnp.array(
        [
            [0.0, jnp.nan, 5.0, jnp.nan],
            [jnp.nan] * 4,
            [0.0, 1.0, 9.0, 2.0],
        ]
    )
    p = params(3, temperature=[1.0, 0.0, 1.0], top_k=[2, 0, 0], top_p=[0.5, 1.0, 1.0])
    out = np.asarray(jit_sample(logits, keys_for(0, 3), **p))
    assert out[:2].tolist() == [1, 0]
    alone = jit_sample(logits[2:], keys_for(0, 3)[2:], **{n: a[2:] for n, a in p.items()})
    assert int(alone[0]) == out[2]


def test_sample_compiles_once_for_new_parameter_values():
    traces = 0

    def counted(*args):
        nonlocal traces
        traces += 1
        return sample(*args)

    jitted = jax.jit(counted)
    B, V = 3, 16
    logits = jnp.asarray(random_logits(10, B, V))
    settings = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 5, 0.9, 0.0),
        (0.5, 0, 0.3, 0.1),
        ([0.0, 1.0, 2.0], [0, 3, 16], [1.0, 0.5, 0.95], [0.0, 0.0, 0.2]),
    ]
    for seed, (t, k, top_p, m) in enumerate(settings):
        p = params(B, temperature=t, top_k=k, top_p=top_p, min_p=m)
        jitted(logits, keys_for(seed, B), *p.values()).block_until_ready()
    assert traces == 1
    if hasattr(jitted, "_cache_size"):  # A private jax API, so only checked where it exists.
        assert jitted._cache_size() == 1
