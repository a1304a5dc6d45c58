"""The scheduler and the page pool, without a model: a fake step writes each chunk's tokens into
the pages of the sequence's page table and samples from what it reads back, so a page handed to
two sequences, shared wrongly or lost to preemption changes the output."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlm.batching import Batch, PagePool, QueueFullError, Scheduler, ShardedScheduler, Status
from jaxlm.batching.pages import PADDING_PAGE, OutOfPagesError, page_key

VOCAB = 50


def next_token(tokens) -> int:
    """The fake model: the next token is a hash of the whole sequence so far."""
    digest = hashlib.blake2b(bytes(str(list(tokens)), "ascii"), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


def solo(prompt, max_new_tokens, stop_token=None) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        out.append(next_token(tokens))
        tokens.append(out[-1])
        if out[-1] == stop_token:
            break
    return out


class FakeStep:
    """The pages' contents, and a step that writes and reads them by page table."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.slots: dict[tuple[int, int], int] = {}
        self.prefill_tokens = 0

    def __call__(self, batch, stop_token=None):
        size = self.pool.page_size
        sampled, stop = {}, {}
        for chunk in batch.chunks:
            seq = chunk.seq
            assert PADDING_PAGE not in seq.pages
            # A step computes at least the token it samples from.
            assert chunk.tokens
            assert tuple(seq.tokens[chunk.start : chunk.start + len(chunk.tokens)]) == chunk.tokens
            # As a key or value depends on every token before it, a slot holds its prefix.
            for i in range(chunk.start, chunk.start + len(chunk.tokens)):
                self.slots[seq.pages[i // size], i % size] = tuple(seq.tokens[: i + 1])
            if len(chunk.tokens) > 1 or not chunk.sample:
                self.prefill_tokens += len(chunk.tokens)
            if chunk.sample:
                end = chunk.start + len(chunk.tokens)
                held = [self.slots[seq.pages[i // size], i % size] for i in range(end)]
                assert held == [tuple(seq.tokens[: i + 1]) for i in range(end)], seq.id
                sampled[seq.id] = next_token(held[-1])
                stop[seq.id] = sampled[seq.id] == stop_token
        return sampled, stop


def run(scheduler, requests, arrivals, stop_token=None, step=None, max_steps=10_000, spare=0):
    """Submit `requests` (prompt, max_new_tokens) at the step `arrivals` give, run until all
    are done (with pages for `spare` slots more where free, as for drafts); returns the
    sequences, the order in which they were first scheduled and the fake step."""
    step = step or FakeStep(scheduler.pool)
    pending = sorted(zip(arrivals, range(len(requests)), requests, strict=True))
    seqs, started = {}, []
    for t in range(max_steps):
        while pending and pending[0][0] <= t:
            _, i, (prompt, new) = pending.pop(0)
            seqs[i] = scheduler.submit(prompt, new)
        if not scheduler.has_work() and not pending:
            break
        batch = scheduler.schedule(1, spare)
        assert batch.num_tokens <= scheduler.max_num_batched_tokens
        assert all(len(c.seq.pages) <= scheduler.pages_per_seq for c in batch.chunks)
        prefills = [c for c in batch.chunks if c.start + 1 < len(c.seq.tokens)]
        limit = scheduler.max_prefill_chunks
        assert limit is None or len(prefills) <= limit
        several = [len(c.tokens) for c in batch.chunks if len(c.tokens) > 1]
        if scheduler.chunk_shapes and several:
            # The step's chunks fit one of its shapes.
            width = min(w for w in scheduler.chunk_shapes if w >= max(several))
            assert len(several) <= scheduler.chunk_shapes[width]
        assert len({c.seq.id for c in batch.chunks}) == len(batch.chunks)
        for chunk in batch.chunks:
            if chunk.seq.id not in started:
                started.append(chunk.seq.id)
        sampled, stop = step(batch, stop_token)
        scheduler.update(batch, sampled, stop)
        in_use = [p for s in scheduler.running for p in s.pages]
        shared = {p for p in in_use if in_use.count(p) > 1}
        assert all(scheduler.pool.refs(p) >= in_use.count(p) for p in shared)
    else:
        raise AssertionError("the requests did not finish")
    return seqs, started, step


requests_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=1, max_size=24),
        st.integers(1, 8),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(
    requests=requests_strategy,
    arrivals=st.lists(st.integers(0, 12), min_size=10, max_size=10),
    num_pages=st.integers(9, 24),
    page_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 4),
    extra_tokens=st.integers(0, 12),
    prefix_cache=st.booleans(),
    stop_token=st.sampled_from([None, 0, 7]),
    max_prefill_chunks=st.sampled_from([None, 1, 2]),
    chunk_shapes=st.sampled_from([None, {2: 4, 4: 2, 8: 1}, {3: 3, 5: 1}]),
    spare=st.sampled_from([0, 3]),
)
def test_every_sequence_gets_its_solo_tokens_and_every_page_comes_back(
    requests,
    arrivals,
    num_pages,
    page_size,
    max_num_seqs,
    extra_tokens,
    prefix_cache,
    stop_token,
    max_prefill_chunks,
    chunk_shapes,
    spare,
):
    # Small token alphabets make prompts share prefixes; few pages make sequences preempt.
    pool = PagePool(num_pages, page_size, prefix_cache=prefix_cache)
    scheduler = Scheduler(
        pool,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_tokens,
        max_prefill_chunks=max_prefill_chunks,
        chunk_shapes=chunk_shapes,
    )
    fits = [(p, n) for p, n in requests if len(p) + n - 1 <= pool.num_usable * page_size]
    if not fits:
        return
    seqs, _, _ = run(scheduler, fits, arrivals[: len(fits)], stop_token, spare=spare)
    for i, (prompt, new) in enumerate(fits):
        assert seqs[i].status is Status.FINISHED
        assert seqs[i].output == solo(prompt, new, stop_token), (i, seqs[i])
        assert seqs[i].finish_reason == ("stop" if seqs[i].output[-1] == stop_token else "length")
    assert pool.num_in_use == 0
    pool.clear_cache()
    assert pool.num_available == pool.num_usable and pool.num_cached == 0


def test_too_few_pages_preempt_the_newest_and_outputs_stay_exact():
    pool = PagePool(num_pages=9, page_size=2, prefix_cache=False)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16)
    requests = [([1, 2, 3, i], 8) for i in range(4)]
    seqs, started, _ = run(scheduler, requests, [0, 0, 0, 0])
    assert started[:4] == [0, 1, 2, 3]
    assert sum(s.preemptions for s in seqs.values()) > 0
    # The oldest sequence is never the one preempted.
    assert seqs[0].preemptions == 0
    for i, (prompt, new) in enumerate(requests):
        assert seqs[i].output == solo(prompt, new)
    assert pool.num_in_use == 0


def test_a_shared_prefix_is_computed_once():
    page_size, prefix = 4, list(range(10, 22))  # three full pages
    for prefix_cache, computed in ((True, 2), (False, 14)):
        pool = PagePool(num_pages=32, page_size=page_size, prefix_cache=prefix_cache)
        scheduler = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64)
        _, _, step = run(scheduler, [([*prefix, 1, 2], 3)], [0])
        step.prefill_tokens = 0
        seqs, _, _ = run(scheduler, [([*prefix, 3, 4], 3)], [0], step=step)
        second = seqs[0]
        assert second.num_cached == (12 if prefix_cache else 0)
        assert step.prefill_tokens == computed
        assert second.output == solo([*prefix, 3, 4], 3)


def test_short_prompts_start_together_in_chunks_of_one_width():
    pool = PagePool(num_pages=64, page_size=4)
    shapes = {4: 4, 8: 2, 16: 1}
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=16, chunk_shapes=shapes)
    seqs = [scheduler.submit([i + 1] * (2 + i % 3), 1) for i in range(6)]
    long = scheduler.submit(list(range(1, 30)), 1)
    batch = scheduler.schedule()
    # As many prompts as the width of the first one's chunk holds, then the rest.
    assert [c.seq for c in batch.chunks] == seqs[:4]
    scheduler.update(batch, {c.seq.id: 0 for c in batch.chunks})
    batch = scheduler.schedule()
    # The long prompt joins cut to the width of the step's first chunk.
    assert [(c.seq, len(c.tokens)) for c in batch.chunks] == [(seqs[4], 3), (seqs[5], 4), (long, 4)]
    seqs, _, _ = run(scheduler, [([5, 6, 7], 2)] * 9, [0] * 9)
    assert all(s.output == solo([5, 6, 7], 2) for s in seqs.values())


def test_a_prompt_waits_a_step_for_the_page_another_chunk_computes():
    # The choices of one request share their prompt: the first computes its pages, and the
    # others take them from the cache a step later instead of computing them too.
    prompt = list(range(1, 14))  # three full pages and one token, left to a decode step
    for prefix_cache, computed in ((True, 13), (False, 4 * 13)):
        pool = PagePool(num_pages=64, page_size=4, prefix_cache=prefix_cache)
        shapes = {16: 4}
        scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, chunk_shapes=shapes)
        seqs, _, step = run(scheduler, [(prompt, 2)] * 4, [0] * 4)
        assert step.prefill_tokens == computed
        assert all(s.output == solo(prompt, 2) for s in seqs.values())


def test_admission_is_first_come_first_served():
    pool = PagePool(num_pages=64, page_size=4)
    scheduler = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=8)
    requests = [([i] * (3 + 5 * (i % 3)), 2 + i % 4) for i in range(8)]
    _, started, _ = run(scheduler, requests, list(range(8)))
    assert started == list(range(8))


def test_requests_that_cannot_fit_and_a_full_queue_are_refused():
    pool = PagePool(num_pages=5, page_size=4)
    scheduler = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=8, max_queue=2)
    with pytest.raises(ValueError, match=r"needs 17 cache slots; a sequence holds at most 16"):
        scheduler.submit([1] * 10, max_new_tokens=8)
    with pytest.raises(ValueError, match="`max_new_tokens` must be >= 1"):
        scheduler.submit([1], max_new_tokens=0)
    with pytest.raises(ValueError, match="`prompt` is empty"):
        scheduler.submit([], max_new_tokens=1)
    scheduler.submit([1] * 10, max_new_tokens=7)
    scheduler.submit([2], max_new_tokens=1)
    with pytest.raises(QueueFullError, match="`max_queue=2`"):
        scheduler.submit([3], max_new_tokens=1)


def test_cancelled_sequences_give_their_pages_back():
    pool = PagePool(num_pages=16, page_size=2)
    scheduler = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=4)
    running, waiting = scheduler.submit([1, 2, 3, 4, 5], 4), scheduler.submit([6, 7], 4)
    third = scheduler.submit([8], 2)
    scheduler.update(scheduler.schedule(), {})
    assert running.status is Status.RUNNING and running.pages
    scheduler.cancel(running)
    scheduler.cancel(third)
    assert running.finish_reason == third.finish_reason == "cancelled"
    while scheduler.has_work():
        batch = scheduler.schedule()
        scheduler.update(batch, {c.seq.id: 0 for c in batch.chunks if c.sample})
    assert waiting.output == [0] * 4
    assert pool.num_in_use == 0


def test_the_pool_evicts_idle_cached_pages_oldest_first():
    pool = PagePool(num_pages=4, page_size=2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.publish(a[0], page_key(0, [1, 2]))
    pool.publish(b[0], page_key(0, [3, 4]))
    pool.release(a)
    pool.release(b)
    assert pool.num_cached == 2 and pool.num_available == 3
    assert pool.match_prefix([3, 4, 5]) == b
    pool.release(b)
    # One free page, then `a` (idle longest), then `b`.
    first = pool.allocate(2)
    assert first[1] == a[0] and pool.match_prefix([1, 2, 9]) == []
    assert pool.match_prefix([3, 4, 9]) == b
    with pytest.raises(OutOfPagesError, match="1 pages asked for, 0 available"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="`num_pages` must be at least 2"):
        PagePool(1, 4)


def test_each_full_page_is_hashed_and_published_once(monkeypatch):
    # Long sequences decoding many steps: the prefix cache hashes each page once, when it
    # fills, not every full page of every sequence at every step.
    hashed = []

    def counting(previous, tokens):
        hashed.append(tuple(tokens))
        return page_key(previous, tokens)

    monkeypatch.setattr("jaxlm.batching.scheduler.page_key", counting)
    monkeypatch.setattr("jaxlm.batching.pages.page_key", counting)
    page_size = 4
    pool = PagePool(num_pages=200, page_size=page_size)
    scheduler = Scheduler(pool, max_num_seqs=3, max_num_batched_tokens=64)
    requests = [(list(range(1, 1 + n)), 40) for n in (90, 130, 61)]
    seqs, _, _ = run(scheduler, requests, [0, 0, 1])
    for (prompt, new), seq in zip(requests, seqs.values(), strict=True):
        assert seq.output == solo(prompt, new)
    # The last sampled token is never computed, so each sequence fills its pages up to it.
    filled = sum((len(prompt) + new - 1) // page_size for prompt, new in requests)
    assert len(hashed) == filled
    # Every page was published under the key of its whole prefix: a new prompt that repeats the
    # longest sequence finds all of its full pages.
    longest = seqs[1].tokens[:-1]
    assert len(pool.match_prefix([*longest, 0])) == len(longest) // page_size


@settings(max_examples=60, deadline=None)
@given(
    requests=requests_strategy,
    arrivals=st.lists(st.integers(0, 12), min_size=10, max_size=10),
    num_pages=st.integers(5, 16),
    page_size=st.sampled_from([1, 2, 4]),
    extra_tokens=st.integers(0, 12),
    prefix_cache=st.booleans(),
    chunk_shapes=st.sampled_from([None, {2: 4, 4: 2, 8: 1}, {3: 3, 5: 1}]),
)
def test_shards_of_data_run_their_own_sequences_on_their_own_pages(
    requests, arrivals, num_pages, page_size, extra_tokens, prefix_cache, chunk_shapes
):
    # Two shards of two slots, each with a pool and a fake step of its own: a page of one
    # shard's pool handed to a sequence of the other reads back the other's tokens.
    pools = [PagePool(num_pages, page_size, prefix_cache=prefix_cache) for _ in range(2)]
    scheduler = ShardedScheduler(
        pools, max_num_seqs=4, max_num_batched_tokens=2 + extra_tokens, chunk_shapes=chunk_shapes
    )
    steps = [FakeStep(pool) for pool in pools]
    fits = [(p, n) for p, n in requests if len(p) + n - 1 <= (num_pages - 1) * page_size]
    pending = sorted(zip(arrivals, range(len(fits)), fits, strict=False))
    seqs = {}
    for t in range(10_000):
        while pending and pending[0][0] <= t:
            _, i, (prompt, new) = pending.pop(0)
            seqs[i] = scheduler.submit(prompt, new)
        if not scheduler.has_work() and not pending:
            break
        batch = scheduler.schedule()
        sampled, stop = {}, {}
        several = [len(c.tokens) for c in batch.chunks if len(c.tokens) > 1]
        for d, step in enumerate(steps):
            chunks = tuple(c for c in batch.chunks if c.seq.shard == d)
            assert all(c.seq.slot in (0, 1) for c in chunks)
            assert sum(len(c.tokens) for c in chunks) <= 2 + extra_tokens
            if chunk_shapes and several:
                # Every shard's chunks fit one shape of the width they all pad to.
                width = min(w for w in chunk_shapes if w >= max(several))
                assert sum(len(c.tokens) > 1 for c in chunks) <= chunk_shapes[width]
            for out, value in zip((sampled, stop), step(Batch(chunks)), strict=True):
                out.update(value)
        scheduler.update(batch, sampled, stop)
    else:
        raise AssertionError("the requests did not finish")
    for i, (prompt, new) in enumerate(fits):
        assert seqs[i].status is Status.FINISHED
        assert seqs[i].output == solo(prompt, new), (i, seqs[i])
    assert [pool.num_in_use for pool in pools] == [0, 0]


def step_all(scheduler) -> Batch:
    """Schedule a step and record token 1 for every chunk that samples."""
    batch = scheduler.schedule()
    scheduler.update(batch, {c.seq.id: 1 for c in batch.chunks if c.sample})
    return batch


def test_shards_of_data_share_the_sequences_and_their_cached_prefixes():
    pools = [PagePool(9, 4), PagePool(9, 4)]
    scheduler = ShardedScheduler(pools, max_num_seqs=4, max_num_batched_tokens=32)
    prompt = [5, 6, 7, 8, 1, 2, 3, 4, 9]
    # Two sequences at once run one on each shard, not both on the first.
    x = scheduler.submit([9, 9, 9], 20)
    a = scheduler.submit(prompt, 1)
    step_all(scheduler)
    assert (x.shard, a.shard, a.status) == (0, 1, Status.FINISHED)
    # `a`'s two full pages stay cached on shard 1. With one sequence running on each shard, the
    # next prompt that starts with them goes there, and takes them.
    y = scheduler.submit([8, 8, 8], 20)
    step_all(scheduler)
    assert y.shard == 1
    b = scheduler.submit([*prompt[:8], 4, 4], 2)
    step_all(scheduler)
    assert (b.shard, b.num_cached) == (1, 8)


def test_shards_of_data_take_the_queue_in_turns():
    pools = [PagePool(9, 4), PagePool(9, 4)]
    with pytest.raises(ValueError, match=r"`max_num_seqs=3` is not a multiple of the mesh axis"):
        ShardedScheduler(pools, max_num_seqs=3, max_num_batched_tokens=16)
    scheduler = ShardedScheduler(pools, max_num_seqs=4, max_num_batched_tokens=16)
    seqs = [scheduler.submit([1, 2, i], 4) for i in range(5)]
    batch = scheduler.schedule()
    # Four slots on two shards: two sequences each, numbered from each shard's own slot 0,
    # and the fifth waits.
    assert sorted((c.seq.shard, c.seq.slot) for c in batch.chunks) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert list(scheduler.waiting) == [seqs[4]]
    scheduler.cancel(seqs[4])
    running = [c.seq for c in batch.chunks]
    scheduler.cancel(running[-1])
    assert running[-1].status is Status.FINISHED and not scheduler.waiting
    assert sum(len(s.running) for s in scheduler.shards) == 3
