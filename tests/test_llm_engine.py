"""`LLMEngine`: requests batched continuously over a paged cache give what each gives alone."""

from __future__ import annotations

import random
import re
import threading
import time

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm.batching.engine import LLMEngine
from jaxlm.memory import ExecutableMemory


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    return model


def solo(model, prompt, new, **kw):
    out = jaxlm.generate(model, None, [prompt], max_new_tokens=new, stop_token_ids=[], **kw)
    return out.token_ids[0]


def requests(seed: int, n: int, vocab: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([5, 9, 17, 33, 60, 90])
        out.append(([rng.randrange(vocab) for _ in range(length)], rng.randint(1, 32)))
    return out


def submit_from_threads(engine, reqs, threads=4, **kw):
    """Submit `reqs` from `threads` threads at staggered times; the handles in order."""
    handles = [None] * len(reqs)

    def run(k):
        for i in range(k, len(reqs), threads):
            prompt, new = reqs[i]
            handles[i] = engine.submit(prompt, max_new_tokens=new, stop_token_ids=[], **kw)
            time.sleep(0.01 * (i % 3))

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return handles


def test_requests_from_threads_equal_their_solo_runs_and_compile_nothing(tiny):
    reqs = requests(0, 16, tiny.config.vocab_size)
    expected = [solo(tiny, p, n) for p, n in reqs]
    with LLMEngine(tiny, max_num_seqs=4, page_size=4, num_pages=96, max_num_batched_tokens=32) as e:
        with jaxlm.CompileCounter() as compiles:
            handles = submit_from_threads(e, reqs)
            results = [h.result(timeout=300) for h in handles]
        assert compiles.builds == 0
        assert [r.token_ids for r in results] == expected
        assert all(r.finish_reason == "length" for r in results)
        assert e.pool.num_in_use == 0
        stats = e.stats()
        assert (stats.running, stats.waiting, stats.pages_in_use, stats.finished) == (0, 0, 0, 16)
        assert stats.generated_tokens == sum(n for _, n in reqs)
        assert stats.prefill_tokens == sum(len(p) for p, _ in reqs) - stats.cached_prompt_tokens
        e.pool.clear_cache()
        assert e.pool.num_available == e.pool.num_usable


def test_seeded_sampling_reproduces_whatever_runs_beside_it(tiny):
    reqs = requests(1, 6, tiny.config.vocab_size)
    kw = dict(temperature=0.9, top_p=0.9, seed=7)
    expected = [solo(tiny, p, n, **kw) for p, n in reqs]
    with LLMEngine(tiny, max_num_seqs=3, page_size=4, num_pages=80, max_num_batched_tokens=16) as e:
        results = [h.result(timeout=300) for h in submit_from_threads(e, reqs, **kw)]
    assert [r.token_ids for r in results] == expected


def test_too_few_pages_preempt_and_every_output_stays_exact(tiny):
    reqs = [(p, 32) for p, _ in requests(2, 6, tiny.config.vocab_size)]
    expected = [solo(tiny, p, n) for p, n in reqs]
    # 32 usable pages of 4 slots: three sequences of up to 122 tokens cannot all grow.
    with LLMEngine(tiny, max_num_seqs=3, page_size=4, num_pages=33, max_num_batched_tokens=16) as e:
        handles = [e.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in reqs]
        results = [h.result(timeout=300) for h in handles]
        assert e.pool.num_in_use == 0
    assert sum(h.seq.preemptions for h in handles) > 0
    assert [r.token_ids for r in results] == expected


def test_a_shared_prefix_is_computed_once(tiny):
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, tiny.config.vocab_size, 64).tolist()
    first, second = [*prefix, 5, 6, 7], [*prefix, 8, 9]
    for cache, computed in ((True, 2), (False, 66)):
        with LLMEngine(
            tiny, max_num_seqs=2, page_size=4, num_pages=64, prefix_cache=cache
        ) as engine:
            engine.generate([first], max_new_tokens=4, stop_token_ids=[])
            before = engine.prefill_tokens
            (out,) = engine.generate([second], max_new_tokens=4, stop_token_ids=[])
            assert engine.prefill_tokens - before == computed
        assert out.token_ids == solo(tiny, second, 4)


def test_text_stop_strings_and_streaming(tiny_chat):
    model, tok = jaxlm.load(tiny_chat)
    prompt = "Once upon a time"
    reference = jaxlm.generate(model, tok, prompt, max_new_tokens=24, stop=["e"])
    with LLMEngine(model, tok, max_num_seqs=2, page_size=8, num_pages=40) as engine:
        handle = engine.submit(prompt, max_new_tokens=24, stop=["e"])
        pieces = list(handle)
        out = handle.result()
    assert "".join(pieces) == out.text == reference.texts[0]
    assert out.token_ids == reference.token_ids[0]
    assert out.finish_reason == reference.finish_reasons[0]


def test_bad_requests_and_a_budget(tiny):
    with LLMEngine(tiny, max_num_seqs=2, page_size=4, budget="64MiB") as engine:
        assert engine.total_bytes <= 64 << 20
        assert engine.pool.num_pages * 4 >= 2 * tiny.config.max_position_embeddings
        with pytest.raises(ValueError, match="`max_position_embeddings=128`"):
            engine.submit([1] * 100, max_new_tokens=40)
        with pytest.raises(ValueError, match="`temperature`"):
            engine.submit([1, 2], max_new_tokens=4, temperature=-1)
        with pytest.raises(ValueError, match="one prompt"):
            engine.submit([[1, 2], [3]], max_new_tokens=4)
    with pytest.raises(ValueError, match="give one of `num_pages` and `budget`"):
        LLMEngine(tiny)


def test_every_step_updates_the_pages_in_place(tiny):
    with LLMEngine(tiny, max_num_seqs=2, page_size=4, num_pages=400) as engine:
        k_shape = engine.pages["layers"][0]["self_attn"]["k_pages"].shape
        shape = "f32[" + ",".join(map(str, k_shape)) + "]"
        assert set(engine.compiled) == {0, 16, 32, 64, 128, 256}
        # Ten times the pages: XLA aliases all of them, and the temporaries stay the same, so
        # they hold no copy of the pages.
        more = {w: ExecutableMemory.of("", e) for w, e in engine._compile(4000).items()}
        for width, executable in engine.compiled.items():
            memory = engine.executables[width]
            assert memory.alias >= engine.pages_bytes, width
            assert more[width].alias >= 10 * engine.pages_bytes, width
            assert more[width].temp == memory.temp, width
            assert not re.search(rf"= {re.escape(shape)}\S* copy\(", executable.as_text()), width
        before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.pages)]
        engine.generate([[1, 2, 3] * 10, [4, 5]], max_new_tokens=5, stop_token_ids=[])
        assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.pages)] == before


def test_a_cancelled_request_ends_and_gives_its_pages_back(tiny):
    with LLMEngine(tiny, max_num_seqs=2, page_size=4, num_pages=64) as engine:
        handle = engine.submit([1, 2, 3], max_new_tokens=100, stop_token_ids=[])
        other = engine.submit([4, 5], max_new_tokens=6, stop_token_ids=[])
        while not handle.token_times:
            time.sleep(0.01)
        handle.cancel()
        result = handle.result(timeout=60)
        assert result.finish_reason == "cancelled" and len(result.token_ids) < 100
        assert other.result(timeout=60).token_ids == solo(tiny, [4, 5], 6)
        while engine.scheduler.has_work():
            time.sleep(0.01)
        assert engine.pool.num_in_use == 0
