"""`LLMEngine`'s repetition penalty and log-probabilities: equal to `generate`'s penalty and to
a NumPy log-softmax of the full forward's logits."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlm
from jaxlm.batching.engine import LLMEngine
from jaxlm.batching.sampled import TOP_LOGPROBS


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    return model


@pytest.fixture(scope="module")
def engine(tiny):
    with LLMEngine(tiny, max_num_seqs=3, page_size=4, num_pages=64, max_num_batched_tokens=32) as e:
        yield e


PROMPTS = [[5, 9, 5, 3, 7, 7, 1], list(range(20, 43)), [11, 2, 11, 2, 11]]


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_k=20, seed=3)])
def test_repetition_penalty_equals_generate(tiny, engine, kw):
    kw = dict(repetition_penalty=1.7, stop_token_ids=[], **kw)
    handles = [engine.submit(p, max_new_tokens=12, **kw) for p in PROMPTS]
    got = [h.result(timeout=300).token_ids for h in handles]
    expected = [
        jaxlm.generate(tiny, None, [p], max_new_tokens=12, **kw)[0].token_ids for p in PROMPTS
    ]
    assert got == expected
    plain = engine.submit(PROMPTS[0], max_new_tokens=12, stop_token_ids=[]).result(timeout=300)
    assert plain.token_ids != got[0]  # the penalty changed something


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
