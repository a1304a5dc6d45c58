"""`LLMEngine(speculative="ngram")`: requests that draft give the tokens they give without, in
batches of requests that come and go, and leave every page as they found it."""

from __future__ import annotations

import random
import re
import threading

import jax
import pytest

import jaxlm
from jaxlm.batching.engine import LLMEngine
from jaxlm.batching.step import Shape

# Prompts that repeat themselves, so that the model's continuations draft often, and others.
LOOPS = [[5, 6, 7, 8] * 5, [9, 10, 11] * 4 + [9, 10], [1, 2, 3] * 10, [40, 41] * 7]


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = [list(p) for p in LOOPS]
    while len(out) < n:
        out.append([rng.randrange(96) for _ in range(rng.choice([3, 9, 17, 30]))])
    return out


@pytest.fixture(scope="module")
def engine(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    # Sharper logits, so that samples fall into loops too (greedy tokens do not change).
    model.lm_head.weight[...] = model.lm_head.weight[...] * 8
    sizes = dict(max_num_seqs=4, page_size=4, num_pages=160, max_num_batched_tokens=32)
    # Chunks of 5 drafts here; the engine of `test_two_hundred_requests...` drafts the default.
    with LLMEngine(model, speculative="ngram", num_speculative_tokens=5, **sizes) as e:
        yield e


def run(engine, reqs, **kwargs):
    """Submit `reqs` from four threads at once; their results in order."""
    handles = [None] * len(reqs)

    def submit(k):
        for i in range(k, len(reqs), 4):
            handles[i] = engine.submit(reqs[i], stop_token_ids=[], **kwargs)

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [h.result(timeout=300) for h in handles]


def drafted(engine):
    s = engine.stats()
    return s.drafted_tokens, s.accepted_tokens


@pytest.mark.parametrize(
    "sampling",
    [
        dict(max_new_tokens=40),
        # Temperatures low enough that samples fall into loops and drafts are kept.
        dict(max_new_tokens=33, temperature=0.3, top_p=0.9, seed=5),
        dict(max_new_tokens=33, temperature=0.5, top_k=8, seed=2, logprobs=3),
    ],
    ids=["greedy", "top-p", "top-k-logprobs"],
)
def test_eight_requests_give_the_same_tokens_with_drafts_as_without(engine, sampling):
    reqs = prompts(0, 8)
    plain = run(engine, reqs, speculative=None, **sampling)
    before = drafted(engine)
    with jaxlm.CompileCounter() as compiles:
        spec = run(engine, reqs, **sampling)
    assert compiles.builds == 0
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
    if "logprobs" in sampling:
        assert [r.logprobs for r in spec] == [r.logprobs for r in plain]
    # Drafts were proposed and kept, not only proposed; without them, none.
    made, kept = (a - b for a, b in zip(drafted(engine), before, strict=True))
    assert made >= kept > 0
    assert made % 5 == 0
    # Each result counts its own drafts: together, the engine's; without drafts, none.
    assert sum(r.drafted_tokens for r in spec) == made
    assert sum(r.accepted_tokens for r in spec) == kept
    assert all(r.drafted_tokens == r.accepted_tokens == 0 for r in plain)
    assert engine.pools[0].num_in_use == 0


def test_stop_tokens_end_a_request_inside_a_kept_chunk(engine):
    reqs = prompts(1, 8)
    plain = run(engine, reqs, speculative=None, max_new_tokens=40)
    # Each request stops at a token its greedy run samples late, often among kept drafts.
    stops = [r.token_ids[25] for r in plain]
    want = [r.token_ids[: r.token_ids.index(s) + 1] for r, s in zip(plain, stops, strict=True)]
    handles = [
        engine.submit(p, max_new_tokens=40, stop_token_ids=[s])
        for p, s in zip(reqs, stops, strict=True)
    ]
    results = [h.result(timeout=300) for h in handles]
    # The stop token is not part of the output, as without drafts.
    assert [[*r.token_ids, s] for r, s in zip(results, stops, strict=True)] == want
    assert all(r.finish_reason == "stop" for r in results)


def test_a_request_cancelled_while_it_drafts_leaves_the_engine_serving(engine):
    # The call with drafts is held until the request is cancelled, so that it returns for a
    # sequence that has left its slot.
    compiled, gate, entered = dict(engine.compiled), threading.Event(), threading.Event()

    def held(shape):
        def call(*args):
            if shape.drafts:
                entered.set()
                gate.wait(timeout=60)
            return compiled[shape](*args)

        return call

    engine.compiled = {shape: held(shape) for shape in compiled}
    try:
        handle = engine.submit(LOOPS[0], max_new_tokens=60, stop_token_ids=[])
        assert entered.wait(timeout=60)
        handle.cancel()
        gate.set()
        assert handle.result(timeout=60).finish_reason == "cancelled"
    finally:
        gate.set()
        engine.compiled = compiled
    want = run(engine, LOOPS[1:2], max_new_tokens=20, speculative=None)[0].token_ids
    assert run(engine, LOOPS[1:2], max_new_tokens=20)[0].token_ids == want
    assert engine.is_running and engine.pools[0].num_in_use == 0


def test_two_hundred_requests_with_drafts_leave_every_page_free(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    # Few pages: sequences that draft take spare pages, and some are preempted.
    sizes = dict(max_num_seqs=4, page_size=4, num_pages=40, max_num_batched_tokens=32)
    rng = random.Random(3)
    reqs = [(p, rng.randint(1, 30)) for p in prompts(3, 200)]
    with LLMEngine(model, speculative="ngram", **sizes) as e:
        plain = [
            e.submit(p, max_new_tokens=n, stop_token_ids=[], speculative=None) for p, n in reqs
        ]
        plain = [h.result(timeout=300).token_ids for h in plain]
        handles = [e.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in reqs]
        assert [h.result(timeout=300).token_ids for h in handles] == plain
        assert e.stats().accepted_tokens > 0
        assert e.stats().preemptions > 0
        assert (e.pools[0].num_in_use, e.stats().running, e.stats().waiting) == (0, 0, 0)
        e.pools[0].clear_cache()
        assert e.pools[0].num_available == e.pools[0].num_usable


def test_the_step_with_drafts_updates_the_pages_in_place(engine):
    k_shape = engine.pages["model"]["layers"][0]["self_attn"]["k_pages"].shape
    shape = "f32[" + ",".join(map(str, k_shape)) + "]"
    step = Shape(0, 0, 5)
    assert engine.num_speculative_tokens == engine.plan.num_speculative_tokens == 5
    assert step in engine.compiled and str(step) == "decode with 5 drafts"
    assert engine.plan.executables[step].alias >= engine.plan.scratch_bytes
    text = engine.compiled[step].as_text()
    assert not re.search(rf"= {re.escape(shape)}\S* copy\(", text)
    before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.pages)]
    engine.generate(LOOPS, max_new_tokens=20, stop_token_ids=[])
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.pages)] == before


def test_bad_speculative_arguments_are_refused(engine):
    # (An engine made without drafts refuses a request that asks for them: `test_llm_engine`.)
    with pytest.raises(ValueError, match="`speculative` must be one of"):
        engine.submit([1, 2], max_new_tokens=2, speculative="eagle")
    with pytest.raises(ValueError, match="`speculative` must be one of"):
        jaxlm.plan(engine.model, max_num_seqs=2, num_pages=8, speculative="eagle")
    with pytest.raises(ValueError, match="`num_speculative_tokens` must be an integer from 1"):
        LLMEngine(engine.model, num_pages=8, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="`num_speculative_tokens` needs `speculative`"):
        jaxlm.plan(engine.model, max_num_seqs=2, num_pages=8, num_speculative_tokens=2)
