"""The penalties, `logit_bias` and log-probabilities of `generate` and `LLMEngine`: equal to each
other, to NumPy over the full forward's logits, and to a NumPy log-softmax of them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.batching.engine import LLMEngine
from jaxlm.batching.sampled import MAX_LOGIT_BIAS, TOP_LOGPROBS, sample_drafts


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    return model


@pytest.fixture(scope="module")
def engine(tiny):
    with LLMEngine(tiny, max_num_seqs=3, page_size=4, num_pages=64, max_num_batched_tokens=32) as e:
        yield e


PROMPTS = [[5, 9, 5, 3, 7, 7, 1], list(range(20, 43)), [11, 2, 11, 2, 11]]


# OpenAI's penalties and a `logit_bias` that favours one token and bans another.
OPENAI = dict(presence_penalty=0.8, frequency_penalty=1.3, logit_bias={7: 4.0, 20: -100})


# Negative penalties, which favour repeats: drafts from the text are kept.
REPEATS = dict(presence_penalty=-2.0, frequency_penalty=-0.5, logit_bias={7: 4.0, 20: -100})


@pytest.mark.parametrize("penalties", [OPENAI, REPEATS], ids=["penalties", "negative"])
def test_openais_penalties_and_bias_in_generate_equal_numpy(tiny, penalties):
    n, prompts = 10, [PROMPTS[0], PROMPTS[2]]
    width = max(map(len, prompts)) + n
    expected = []
    for prompt in prompts:
        ids, out = list(prompt), []
        for _ in range(n):
            # Padded on the right to one width, so that the forward compiles once.
            padded = np.array([ids + [0] * (width - len(ids))])
            logits = np.asarray(tiny(padded))[0, len(ids) - 1].astype(np.float64)
            counts = np.bincount(out, minlength=logits.size)
            logits -= penalties["frequency_penalty"] * counts
            logits -= penalties["presence_penalty"] * (counts > 0)
            for token, bias in penalties["logit_bias"].items():
                logits[token] += bias
            out.append(int(np.argmax(logits)))
            ids.append(out[-1])
        expected.append(out)
    kw = dict(max_new_tokens=n, stop_token_ids=[], **penalties)
    # Two prompts of different lengths share a batch, each penalized by its own tokens alone;
    # with drafts, a chunk's positions each by the tokens before it.
    for speculative in (None, "ngram"):
        got = jaxlm.generate(tiny, None, prompts, speculative=speculative, **kw)
        assert [o.token_ids for o in got] == expected
    plain = jaxlm.generate(tiny, None, prompts, max_new_tokens=n, stop_token_ids=[])
    assert [o.token_ids for o in plain] != expected  # the penalties changed something


def test_each_position_of_a_chunk_is_penalized_by_the_tokens_before_it():
    rng = np.random.default_rng(0)
    rows, width, vocab, slots_per_row, prompt_end = 3, 4, 24, 14, 5
    tokens = rng.integers(0, vocab, (rows, slots_per_row)).astype(np.int32)
    start = np.array([0, 3, 4], np.int32)
    slots = prompt_end + 2 + np.arange(width, dtype=np.int32)
    logits = rng.normal(size=(rows, width, vocab)).astype(np.float32) * 0.5
    # Each position favours the token just before it, which only that position's count holds,
    # and the prompt's last token, which no count holds.
    for j, slot in enumerate(slots):
        logits[np.arange(rows), j, tokens[:, slot - 1]] += 1.5
    logits[np.arange(rows), :, tokens[:, prompt_end - 1]] += 1.2
    repetition = np.array([1.3, 1.0, 2.0], np.float32)
    presence = np.array([0.5, -1.0, 0.0], np.float32)
    frequency = np.array([1.0, 0.7, -0.4], np.float32)
    params = dict(
        params=dict(
            temperature=np.zeros(rows, np.float32),
            top_k=np.zeros(rows, np.int32),
            top_p=np.ones(rows, np.float32),
            min_p=np.zeros(rows, np.float32),
            repetition_penalty=repetition,
        ),
        penalties=dict(presence=presence, frequency=frequency),
        bias_ids=np.full((rows, MAX_LOGIT_BIAS), vocab, np.int32),
        bias=np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
    )
    x = dict(
        params,
        keys=np.zeros((rows, 2), np.uint32),
        masked=np.bool_(False),
        mask=np.zeros((rows, 1), np.int32),
        logprobs=np.bool_(False),
    )
    got = []
    for r in range(rows):
        # The chunk runs the token before each position; the row's seen tokens and generated
        # tokens' counts hold its first.
        first = slots[0] - 1
        ids = jnp.asarray(tokens[r, first : slots[-1]])
        seen = np.zeros(vocab, bool)
        seen[tokens[r, start[r] : first + 1]] = True
        counts = np.bincount(tokens[r, prompt_end : first + 1], minlength=vocab).astype(np.int32)
        generated = jnp.asarray(slots - prompt_end)[None]
        token, *_ = sample_drafts(
            jnp.asarray(logits[r : r + 1]), x, generated, jnp.asarray([r]), ids, seen, counts
        )
        got.append(np.asarray(token[0]))
    expected = np.zeros((rows, width), np.int64)
    for r in range(rows):
        for j, slot in enumerate(slots):
            x = logits[r, j].astype(np.float64)
            seen = np.unique(tokens[r, start[r] : slot])
            x[seen] = np.where(x[seen] < 0, x[seen] * repetition[r], x[seen] / repetition[r])
            counts = np.bincount(tokens[r, prompt_end:slot], minlength=vocab)
            x -= frequency[r] * counts + presence[r] * (counts > 0)
            expected[r, j] = np.argmax(x)
    np.testing.assert_array_equal(np.stack(got), expected)


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.7),
        dict(repetition_penalty=1.7, temperature=0.8, top_k=20, seed=3),
        dict(OPENAI, temperature=0.8, seed=5),
    ],
)
def test_penalties_equal_generate(tiny, engine, kw):
    kw = dict(stop_token_ids=[], **kw)
    handles = [engine.submit(p, max_new_tokens=12, **kw) for p in PROMPTS]
    got = [h.result(timeout=300).token_ids for h in handles]
    expected = [
        jaxlm.generate(tiny, None, [p], max_new_tokens=12, **kw)[0].token_ids for p in PROMPTS
    ]
    assert got == expected
    plain = engine.submit(PROMPTS[0], max_new_tokens=12, stop_token_ids=[]).result(timeout=300)
    assert plain.token_ids != got[0]  # the penalty changed something


def test_penalized_rows_draft_and_run_several_steps_a_call_in_the_engine(tiny):
    # The loop counts each token it samples, so a penalized row runs `decode_steps` a call and
    # drafts, each position penalized by the tokens before it; `generate` checks it above.
    kw = dict(REPEATS, repetition_penalty=1.3, stop_token_ids=[], max_new_tokens=16)
    expected = [jaxlm.generate(tiny, None, [p], **kw)[0].token_ids for p in PROMPTS]
    sizes = dict(max_num_seqs=3, page_size=4, num_pages=64, max_num_batched_tokens=32)
    with LLMEngine(tiny, speculative="ngram", decode_steps=4, **sizes) as engine:
        handles = [engine.submit(p, **kw) for p in PROMPTS]
        assert [h.result(timeout=300).token_ids for h in handles] == expected
        assert engine.accepted_tokens > 0
        assert engine.calls < 12  # one token a call would take 16 or more


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logprobs_equal_a_log_softmax_of_the_full_forward(tiny, engine):
    prompt, k = PROMPTS[1], 5
    out = engine.submit(prompt, max_new_tokens=6, stop_token_ids=[], logprobs=k).result(300)
    ids = np.array([prompt + out.token_ids])
    reference = log_softmax(np.asarray(tiny(ids))[0, len(prompt) - 1 : -1])
    assert [t.token_id for t in out.logprobs] == out.token_ids
    for step, t in enumerate(out.logprobs):
        np.testing.assert_allclose(t.logprob, reference[step, t.token_id], atol=2e-5)
        top = np.argsort(-reference[step], kind="stable")[:k]
        assert [i for i, _ in t.top] == top.tolist()
        np.testing.assert_allclose([p for _, p in t.top], reference[step, top], atol=2e-5)
    plain = engine.submit(prompt, max_new_tokens=6, stop_token_ids=[]).result(300)
    assert plain.logprobs is None and plain.token_ids == out.token_ids


def test_deltas_carry_every_token_once_and_call_back(engine):
    calls = []
    handle = engine.submit(
        PROMPTS[2],
        max_new_tokens=9,
        stop_token_ids=[],
        logprobs=0,
        on_update=lambda: calls.append(1),
    )
    result = handle.result(timeout=300)
    deltas = handle.deltas()
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == result.logprobs
    assert all(t.top == () for t in result.logprobs)
    assert deltas[-1].finish_reason == result.finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert len(calls) >= len(deltas) and handle.deltas() == []


def test_bad_logprobs_are_refused(engine):
    for bad in (-1, TOP_LOGPROBS + 1, 1.5, True):
        with pytest.raises(ValueError, match="`logprobs`"):
            engine.submit([1, 2], max_new_tokens=2, logprobs=bad)
