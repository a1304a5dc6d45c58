"""`LLMEngine`: requests batched continuously over a paged cache give what each gives alone."""

from __future__ import annotations

import gc
import queue
import random
import re
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.batching.engine import LLMEngine
from jaxlm.batching.hostpack import HostPack
from jaxlm.batching.step import Shape
from jaxlm.errors import PlanError

# An engine of two sequences whose steps hold a prompt chunk of 16 tokens at most: its few
# executables compile once (the compilation cache serves the tests after the first), where the
# default `max_num_batched_tokens` of 256 compiles every chunk width up to it.
SMALL = dict(max_num_seqs=2, page_size=4, num_pages=64, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    return model


def solo(model, prompt, new, **kw):
    out = jaxlm.generate(model, None, [prompt], max_new_tokens=new, stop_token_ids=[], **kw)
    return out[0].token_ids


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
        assert e.pools[0].num_in_use == 0
        stats = e.stats()
        assert (stats.running, stats.waiting, stats.pages_in_use, stats.finished) == (0, 0, 0, 16)
        assert stats.generated_tokens == sum(n for _, n in reqs)
        # Every prompt token computed or taken from the cache, some twice if pages ran out.
        covered, prompts = (
            stats.prefill_tokens + stats.cached_prompt_tokens,
            sum(len(p) for p, _ in reqs),
        )
        assert covered == prompts if stats.preemptions == 0 else covered >= prompts
        e.pools[0].clear_cache()
        assert e.pools[0].num_available == e.pools[0].num_usable

        # Short prompts queued while a step runs start together: two chunks of 16 in one step.
        short = [(r, want) for r, want in zip(reqs, expected, strict=True) if len(r[0]) <= 16]
        shapes, gate, compiled = [], threading.Event(), dict(e.compiled)

        def held(shape):
            def call(*args):
                shapes.append(shape)
                gate.wait(timeout=60)
                return compiled[shape](*args)

            return call

        e.compiled = {shape: held(shape) for shape in compiled}
        handles = [e.submit(short[0][0][0], max_new_tokens=short[0][0][1], stop_token_ids=[])]
        while not shapes:
            time.sleep(0.01)
        handles += [e.submit(p, max_new_tokens=n, stop_token_ids=[]) for (p, n), _ in short[1:]]
        gate.set()
        assert [h.result(timeout=300).token_ids for h in handles] == [want for _, want in short]
        assert Shape(2, 16) in shapes


def test_seeded_sampling_reproduces_whatever_runs_beside_it(tiny, small_buckets):
    reqs = requests(1, 6, tiny.config.vocab_size)
    kw = dict(temperature=0.9, top_p=0.9, seed=7)
    expected = [solo(tiny, p, n, **kw) for p, n in reqs]
    # `max_seq_len` alone: pages for every sequence at its longest (122 tokens here), and the
    # padding page, so none is preempted.
    sizes = dict(max_num_seqs=3, page_size=4, max_seq_len=124, max_num_batched_tokens=16)
    with LLMEngine(tiny, **sizes) as e:
        handles = submit_from_threads(e, reqs, **kw)
        results = [h.result(timeout=300) for h in handles]
        assert e.plan.num_pages == 1 + 3 * 124 // 4
    assert [r.token_ids for r in results] == expected
    assert all(h.seq.preemptions == 0 for h in handles)


def test_too_few_pages_preempt_and_every_output_stays_exact(tiny, small_buckets):
    reqs = [(p, 32) for p, _ in requests(2, 6, tiny.config.vocab_size)]
    expected = [solo(tiny, p, n) for p, n in reqs]
    # 32 usable pages of 4 slots: three sequences of up to 122 tokens cannot all grow.
    with LLMEngine(tiny, max_num_seqs=3, page_size=4, num_pages=33, max_num_batched_tokens=16) as e:
        handles = [e.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in reqs]
        results = [h.result(timeout=300) for h in handles]
        assert e.pools[0].num_in_use == 0
    assert sum(h.seq.preemptions for h in handles) > 0
    assert [r.token_ids for r in results] == expected


def test_several_decode_steps_per_call_stop_where_each_request_stops(tiny):
    # Each request stops at a token its greedy run samples halfway, so that rows stop inside a
    # call of several steps while the others go on.
    reqs = []
    for prompt, new in requests(4, 8, tiny.config.vocab_size):
        tokens = solo(tiny, prompt, new)
        kw = dict(max_new_tokens=new, stop_token_ids=[tokens[len(tokens) // 2]])
        reqs.append(dict(prompt=prompt, kw=kw))
    expected = [expected_tokens(tiny, r) for r in reqs]
    for steps in (1, 4):
        with LLMEngine(
            tiny,
            max_num_seqs=4,
            page_size=4,
            num_pages=96,
            max_num_batched_tokens=16,
            decode_steps=steps,
        ) as e:
            handles = [e.submit(r["prompt"], **r["kw"]) for r in reqs]
            results = [h.result(timeout=300) for h in handles]
            stats = e.stats()
            assert e.pools[0].num_in_use == 0
            # One request alone: a call for its prompt, then one per `steps` tokens.
            e.generate([[1, 2, 3]], max_new_tokens=17, stop_token_ids=[])
            assert e.stats().calls - stats.calls == 1 + 16 // steps
        assert [r.token_ids for r in results] == expected, steps
        # The stop tokens were generated, not shown.
        assert stats.generated_tokens == sum(map(len, expected)) + len(reqs)
        assert stats.calls == stats.steps if steps == 1 else stats.calls < stats.steps


def test_a_shared_prefix_is_computed_once(tiny):
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, tiny.config.vocab_size, 64).tolist()
    first, second = [*prefix, 5, 6, 7], [*prefix, 8, 9]
    for cache, computed in ((True, 2), (False, 66)):
        with LLMEngine(tiny, prefix_cache=cache, **SMALL) as engine:
            engine.generate([first], max_new_tokens=4, stop_token_ids=[])
            before = engine.prefill_tokens
            (out,) = engine.generate([second], max_new_tokens=4, stop_token_ids=[])
            assert engine.prefill_tokens - before == computed
        assert out.token_ids == solo(tiny, second, 4)


def test_text_stop_strings_and_streaming(tiny_chat):
    model, tok = jaxlm.load(tiny_chat)
    prompt = "Once upon a time"
    reference = jaxlm.generate(model, tok, prompt, max_new_tokens=24, stop=["e"])
    with LLMEngine(model, tok, **{**SMALL, "page_size": 8, "num_pages": 40}) as engine:
        handle = engine.submit(prompt, max_new_tokens=24, stop=["e"])
        deltas = list(handle)
        out = handle.result()
        # Iterated again, as a notebook cell run again: the same deltas, from the start.
        assert iterate(handle) == deltas
    (expected,) = reference
    assert "".join(d.text for d in deltas) == out.text == expected.text
    assert out.token_ids == expected.token_ids
    assert out.finish_reason == expected.finish_reason
    # The deltas hold the output's tokens, and the last one why it ended.
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert deltas[-1].finish_reason == out.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])


def iterate(handle, timeout: float = 60.0) -> list[jaxlm.Delta]:
    """The deltas of one iteration of `handle`, or what it raised; fails, rather than hangs, if
    it does not end."""
    result = {}

    def run():
        try:
            result["pieces"] = list(handle)
        except Exception as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"iterating the handle did not end within {timeout} s"
    if "error" in result:
        raise result["error"]
    return result["pieces"]


def test_an_error_before_a_call_fails_every_request(tiny):
    # Scheduling and packing a call's inputs run on the engine's thread too: an error there
    # ends the engine, and every request learns of it instead of waiting forever.
    with LLMEngine(tiny, **SMALL) as engine:

        def broken(*args, **kwargs):
            raise RuntimeError("the scheduler broke")

        engine.scheduler.schedule = broken
        handle = engine.submit([1, 2, 3], max_new_tokens=4, stop_token_ids=[])
        with pytest.raises(RuntimeError, match="the scheduler broke"):
            handle.result(timeout=60)
        with pytest.raises(RuntimeError, match="the scheduler broke"):
            iterate(handle)
        assert not engine.is_running


def test_bad_requests_and_a_budget(tiny, tiny_llama):
    with (
        jaxlm.CompileCounter() as compiles,
        LLMEngine(
            tiny, max_num_seqs=2, page_size=4, budget="64MiB", max_num_batched_tokens=32
        ) as engine,
    ):
        plan = engine.plan
        # Fitting the pages compiles each step once, and the few whose temporaries are the
        # largest once more, with the fewest pages: the two prompt chunks of the most tokens
        # and decode (`jaxlm.batching.plan._probes`), and the zeros the pages start as.
        assert len(plan.compiled) < compiles.builds <= len(plan.compiled) + 4
        assert plan.total_bytes <= 64 << 20
        # The bill is what the engine allocated (weights and pages) and XLA's temporaries, read
        # here from the executables themselves; one more page would not have fit.
        pages = sum(x.nbytes for x in jax.tree.leaves(engine.pages))
        weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(tiny)))
        temp = max(e.memory_analysis().temp_size_in_bytes for e in engine.compiled.values())
        assert pages == plan.scratch_bytes and weights == plan.weights_bytes
        assert abs(plan.total_bytes - (weights + pages + temp)) <= 0.02 * plan.total_bytes
        assert plan.total_bytes + pages // plan.num_pages > 64 << 20
        assert engine.pools[0].num_pages * 4 >= 2 * tiny.config.max_position_embeddings
        with pytest.raises(ValueError, match="`max_position_embeddings=128`"):
            engine.submit([1] * 100, max_new_tokens=40)
        with pytest.raises(ValueError, match="`temperature`"):
            engine.submit([1, 2], max_new_tokens=4, temperature=-1)
        with pytest.raises(ValueError, match="one prompt"):
            engine.submit([[1, 2], [3]], max_new_tokens=4)
        # An argument of `generate` that a request does not take, named.
        with pytest.raises(TypeError, match="unexpected argument `plan`: not a field of"):
            engine.submit([1, 2], max_new_tokens=4, plan=plan)
        with pytest.raises(ValueError, match=r'needs an engine that verifies drafts: .*"ngram"'):
            engine.submit([1, 2], max_new_tokens=4, speculative="ngram")
        # One process serves: `follow` is for the others of a mesh across processes.
        with pytest.raises(RuntimeError, match="`follow` runs on the processes other than 0"):
            engine.follow()
    with pytest.raises(ValueError, match="give `num_pages`, `budget` or `max_seq_len`"):
        LLMEngine(tiny)
    with pytest.raises(ValueError, match="give `num_pages` or `budget`, not both"):
        LLMEngine(tiny, num_pages=8, budget="1GiB")
    with pytest.raises(ValueError, match=r"give a `plan` or its sizes \(`num_pages`\)"):
        LLMEngine(tiny, None, engine.plan, num_pages=8)
    other, _ = jaxlm.load(tiny_llama[0])
    with pytest.raises(ValueError, match="`plan` was made for another model"):
        LLMEngine(other, None, engine.plan)
    with pytest.raises(ValueError, match="`max_batch` size `generate`'s plan"):
        jaxlm.plan(tiny, max_num_seqs=2, max_batch=2, num_pages=8)
    with pytest.raises(ValueError, match="`num_pages` size an engine's plan"):
        jaxlm.plan(tiny, max_batch=2, num_pages=8)
    # A budget below the weights and two pages is refused, with the numbers, before compiling.
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(tiny)))
    with pytest.raises(PlanError, match=r"does not hold the weights, \d+\.\d\d KiB, and 2 pages"):
        jaxlm.plan(tiny, max_num_seqs=2, budget=weights + 100)
    for steps in (0, 1.5):
        with pytest.raises(ValueError, match="`decode_steps` must be a positive integer"):
            LLMEngine(tiny, num_pages=8, decode_steps=steps)


def test_a_budget_fits_the_pages_whichever_step_needs_the_most(tiny, monkeypatch):
    # Should the steps compiled first with the fewest pages not be those with the largest
    # temporaries (here the lone row's decode, the smallest), the pages still fit exactly.
    from jaxlm.batching import plan as engine_plan

    sizes = dict(max_num_seqs=2, page_size=4, budget="64MiB", max_num_batched_tokens=32)
    fitted = jaxlm.plan(tiny, **sizes)
    monkeypatch.setattr(engine_plan, "_probes", lambda steps: [Shape(0, 0, 0, 1)])
    plan = jaxlm.plan(tiny, **sizes)
    page = plan.scratch_bytes // plan.num_pages
    assert plan.total_bytes <= 64 << 20 < plan.total_bytes + page
    assert plan.num_pages == fitted.num_pages


def test_a_host_pack_round_trips_every_dtype_through_a_jit():
    # Each field against the NumPy array it came from, odd sizes included (fields pad to 4).
    rng = np.random.default_rng(0)
    tree = dict(
        a=rng.integers(-(2**31), 2**31 - 1, (3, 5), dtype=np.int32),
        b=dict(c=rng.random(7).astype(np.float32), d=rng.random((2, 3)) > 0.5),
        e=np.uint32(4_000_000_000),
        f=np.bool_(True),
        g=rng.integers(0, 2**32, (4, 2), dtype=np.uint32),
        # Not contiguous in C order.
        h=rng.random((4, 3)).astype(np.float32).T,
    )
    pack = HostPack(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree))
    back = jax.jit(pack.unpack)(pack.pack(tree))
    for want, got in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert got.dtype == want.dtype and got.shape == np.shape(want)
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match=r"shape \(3, 5\)"):
        pack.pack({**tree, "a": np.zeros((5, 3), np.int32)})


def test_every_step_updates_the_pages_in_place(tiny, small_buckets):
    sizes = dict(max_num_seqs=2, page_size=4, max_num_batched_tokens=64)
    with LLMEngine(tiny, num_pages=400, **sizes) as engine:
        k_shape = engine.pages["model"]["layers"][0]["self_attn"]["k_pages"].shape
        shape = "f32[" + ",".join(map(str, k_shape)) + "]"
        # Decode alone, and one or two prompt chunks of each width that 64 tokens hold.
        assert set(engine.compiled) == {
            Shape(0, 0),
            Shape(0, 0, rows=1),
            Shape(1, 16),
            Shape(2, 16),
            Shape(1, 32),
            Shape(2, 32),
            Shape(1, 64),
        }
        # Ten times the pages: XLA aliases all of them, and the temporaries stay the same, so
        # they hold no copy of the pages.
        more = jaxlm.plan(tiny, num_pages=4000, **sizes).executables
        pages_bytes = engine.plan.scratch_bytes
        for step, executable in engine.compiled.items():
            memory = engine.plan.executables[step]
            assert memory.alias >= pages_bytes, step
            assert more[step].alias >= 10 * pages_bytes, step
            assert more[step].temp == memory.temp, step
            assert not re.search(rf"= {re.escape(shape)}\S* copy\(", executable.as_text()), step
        before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.pages)]
        engine.generate([[1, 2, 3] * 10, [4, 5]], max_new_tokens=5, stop_token_ids=[])
        assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.pages)] == before


def test_a_lone_request_decodes_over_its_own_row(tiny):
    # A step of every slot's column costs one sequence twice its own: while the first slot
    # alone runs, decode steps run its row alone, and give the tokens they give beside others.
    with LLMEngine(tiny, **SMALL) as engine:
        shapes, compiled = [], dict(engine.compiled)

        def recorded(shape):
            def call(*args):
                shapes.append(shape)
                return compiled[shape](*args)

            return call

        engine.compiled = {shape: recorded(shape) for shape in compiled}
        alone = engine.submit([1, 2, 3], max_new_tokens=12, stop_token_ids=[])
        assert alone.result(timeout=60).token_ids == solo(tiny, [1, 2, 3], 12)
        assert str(Shape(0, 0, rows=1)) == "decode of 1 row"
        assert Shape(0, 0, rows=1) in shapes and Shape(0, 0) not in shapes
        shapes.clear()
        reqs = [([1, 2, 3], 12), ([7, 8, 9, 10], 20)]
        handles = [engine.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in reqs]
        assert [h.result(timeout=60).token_ids for h in handles] == [solo(tiny, *r) for r in reqs]
        # Both rows while both run, then the first slot's alone; the second slot never alone.
        assert Shape(0, 0) in shapes and shapes[-1] == Shape(0, 0)
        assert engine.scheduler._free_slots == [0, 1]


def test_a_cancelled_request_ends_and_gives_its_pages_back(tiny):
    with LLMEngine(tiny, **SMALL) as engine:
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
        assert engine.pools[0].num_in_use == 0


def soak_requests(seed: int, n: int, vocab: int) -> list[dict]:
    """`n` short requests: prompts that often start with one of three shared prefixes (whole
    pages of 4), greedy or seeded sampling, some with stop ids, some to be cancelled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(k)] for k in (4, 8, 12)]
    out = []
    for i in range(n):
        head = rng.choice([[], *prefixes])
        prompt = head + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        kw = dict(max_new_tokens=rng.randint(1, 8), stop_token_ids=[])
        if rng.random() < 0.25:
            kw["stop_token_ids"] = rng.sample(range(vocab), 12)
        if rng.random() < 0.25:
            kw.update(temperature=0.8, top_k=20, seed=i)
        out.append(dict(prompt=prompt, kw=kw, cancel=rng.random() < 0.1))
    return out


def expected_tokens(model, request) -> list[int]:
    """The request's tokens alone: `generate` without stop ids, cut before the first stop id."""
    kw = dict(request["kw"])
    new, stops = kw.pop("max_new_tokens"), set(kw.pop("stop_token_ids"))
    tokens = solo(model, request["prompt"], new, **kw)
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:cut]


def serve(engine, reqs, threads=4):
    """Submit `reqs` from `threads` threads, cancelling those marked a few ms later from
    another; every result, in order."""
    handles = [None] * len(reqs)
    to_cancel: queue.Queue = queue.Queue()

    def submit(k):
        for i in range(k, len(reqs), threads):
            handles[i] = engine.submit(reqs[i]["prompt"], **reqs[i]["kw"])
            if reqs[i]["cancel"]:
                to_cancel.put(handles[i])
            if i % 7 == 0:
                time.sleep(0.002)
        to_cancel.put(None)

    def cancel():
        done = 0
        while done < threads:
            handle = to_cancel.get()
            if handle is None:
                done += 1
                continue
            time.sleep(0.001 * (handle.seq.id % 4))
            handle.cancel()

    workers = [threading.Thread(target=submit, args=(k,)) for k in range(threads)]
    workers.append(threading.Thread(target=cancel))
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return handles, [h.result(timeout=300) for h in handles]


def test_a_soak_of_500_requests_leaves_pages_and_arrays_as_they_were(tiny):
    vocab = tiny.config.vocab_size
    warm, reqs = soak_requests(4, 40, vocab), soak_requests(5, 500, vocab)
    # 11 usable pages of 4 slots for 4 sequences of up to 29 tokens: some are preempted.
    with LLMEngine(tiny, max_num_seqs=4, page_size=4, num_pages=12, max_num_batched_tokens=32) as e:
        serve(e, warm)
        while e.scheduler.has_work():
            time.sleep(0.01)
        gc.collect()
        before, arrays = e.stats(), len(jax.live_arrays())
        handles, results = serve(e, reqs)
        while e.scheduler.has_work():
            time.sleep(0.01)
        gc.collect()
        # At most as many: an earlier test's arrays may be freed meanwhile, never ours kept.
        assert len(jax.live_arrays()) <= arrays
        stats = e.stats()
        e.pools[0].clear_cache()
        cleared = e.stats()
    for request, handle, result in zip(reqs, handles, results, strict=True):
        expected = expected_tokens(tiny, request)
        if result.finish_reason == "cancelled":
            assert result.token_ids == expected[: len(result.token_ids)]
        else:
            assert result.token_ids == expected
            stopped = len(expected) < request["kw"]["max_new_tokens"]
            assert result.finish_reason == ("stop" if stopped else "length")
        assert result.prompt_token_ids == request["prompt"]
        assert handle.seq.pages == [] and handle.seq.slot is None
    reasons = [r.finish_reason for r in results]
    assert 0 < reasons.count("cancelled") < 100 and reasons.count("stop") > 0
    assert (stats.running, stats.waiting, stats.pages_in_use) == (0, 0, 0)
    assert stats.finished - before.finished == len(reqs) - reasons.count("cancelled")
    # Every token a step sampled for a request is in its sequence's output, stop ids included.
    generated = sum(len(h.seq.output) for h in handles)
    assert stats.generated_tokens - before.generated_tokens == generated
    assert stats.preemptions - before.preemptions == sum(h.seq.preemptions for h in handles) > 0
    # Each prompt that ran to its end was computed or taken from the cache, once or more.
    cached = stats.cached_prompt_tokens - before.cached_prompt_tokens
    prefilled = stats.prefill_tokens - before.prefill_tokens
    assert cached > 0
    assert prefilled + cached >= sum(
        len(q["prompt"])
        for q, r in zip(reqs, results, strict=True)
        if r.finish_reason != "cancelled"
    )
    assert stats.pages_cached > 0 and stats.pages_free + stats.pages_in_use == stats.pages_total
    assert (cleared.pages_free, cleared.pages_cached) == (cleared.pages_total, 0)
