"""Continuous batching: which sequences run in the next step, and with which pages.

Plain Python over plain data, with no model: the step that computes the tokens reads the
`Batch` a `schedule()` returns and reports the sampled tokens back through `update()`.

Each step runs, within `max_num_batched_tokens` tokens, one token of every running sequence
that is decoding, then chunks of prompts (chunked prefill): those of sequences already
prefilling, then new ones admitted while a slot of the `max_num_seqs` rows and pages allow, at
most `max_prefill_chunks` of them. With `chunk_shapes` (`{width: most chunks}`, the shapes a
step runs), a step's chunks share one width, the first one's: later ones join cut to that width
while their number fits, so that many short prompts start in one step. Prompts of one token,
which a step runs as decode tokens, are admitted beyond either limit. A prompt whose next page
another chunk of the step computes waits a step, to take it from the prefix cache.

A sequence that needs a page when none is available preempts the newest running sequence,
whose pages are freed and which goes back to the front of the queue, to be computed again from
its prompt and the tokens it had generated.

Sequences submitted in one `group` (the choices of one request) share the slots with the
others: admission takes the waiting sequence whose group runs the fewest (first come, first
served among equals), and a group that waits with none running, when no slot is free, preempts
the newest sequence of the group that runs the most, if that group runs several. One request
of many choices cannot hold every slot while another waits.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import itertools
from collections.abc import Hashable, Mapping, Sequence

from jaxlm.batching.pages import PagePool, page_key
from jaxlm.errors import JaxlmError


class QueueFullError(JaxlmError):
    """Raised by `submit` when the queue of waiting requests is full."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class SequenceState:
    """One request as the scheduler sees it: its tokens, its pages, how far it has run."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    # The request the sequence belongs to, whose sequences share the slots as one.
    group: Hashable = None
    output: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    # The shard of a mesh's `data` axis whose slots and pages it runs on (`ShardedScheduler`).
    shard: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose keys and values are in the pages (computed or shared from the cache).
    num_computed: int = 0
    num_cached: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    # The prefix-cache key of each full page computed so far (`page_key`), kept across
    # preemptions, and how many of `pages` are published.
    keys: list[int] = dataclasses.field(default_factory=list)
    published: int = 0
    # With drafts (`jaxlm.batching.loop`): the tokens to wait before drafting again, the
    # wait after the next chunk that keeps no draft, and the tokens whose keys and values a
    # draft model's pages hold.
    draft_wait: int = 0
    draft_backoff: int = 1
    draft_len: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """`tokens[start:end]`, without joining the prompt and the output."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]

    @property
    def prefilling(self) -> bool:
        """Whether tokens before the last one remain to be computed."""
        return self.num_computed < self.num_tokens - 1


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A sequence's tokens `tokens`, at positions `start ..`, in one step; `sample` says
    whether the step samples the sequence's next token from the chunk's last position."""

    seq: SequenceState
    start: int
    tokens: tuple[int, ...]
    sample: bool


@dataclasses.dataclass(frozen=True)
class Batch:
    """What one step runs: decode chunks (one token each) first, then prefill chunks."""

    chunks: tuple[Chunk, ...]
    preempted: tuple[SequenceState, ...] = ()
    # The decode steps to run back to back (a batch of decode chunks alone), each feeding the
    # token the last sampled; every sequence has pages for all of them.
    steps: int = 1
    # The width of its chunks of several tokens (with `chunk_shapes`).
    width: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


class Scheduler:
    """Admits, runs and retires sequences over a `PagePool`.

    Example:
        >>> scheduler = Scheduler(PagePool(17, 16), max_num_seqs=4, max_num_batched_tokens=64)
        >>> seq = scheduler.submit([1, 2, 3], max_new_tokens=2)
        >>> batch = scheduler.schedule()          # the prompt, in one chunk
        >>> scheduler.update(batch, {seq.id: 7})  # the token the step sampled
        []
        >>> seq.output
        [7]
    """

    def __init__(
        self,
        pool: PagePool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pages_per_seq: int | None = None,
        max_queue: int = 1024,
        max_prefill_chunks: int | None = None,
        chunk_shapes: Mapping[int, int] | None = None,
        shard: int = 0,
        queue: Scheduler | None = None,
    ):
        """`shard` and `queue` make the scheduler of one shard of a mesh's `data` axis
        (`ShardedScheduler`): it admits from the queue of the scheduler `queue` and numbers its
        sequences with it."""
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                "`max_num_seqs` must be positive and `max_num_batched_tokens` at least "
                f"`max_num_seqs`, got {max_num_seqs} and {max_num_batched_tokens}"
            )
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pages_per_seq = pages_per_seq or pool.num_usable
        self.max_queue = max_queue
        self.max_prefill_chunks = max_prefill_chunks
        self.chunk_shapes = dict(sorted(chunk_shapes.items())) if chunk_shapes else None
        self.shard = shard
        self.waiting: collections.deque[SequenceState] = (
            collections.deque() if queue is None else queue.waiting
        )
        self.running: list[SequenceState] = []
        # A heap: a sequence takes the lowest free slot, so that a few running sequences hold
        # the first rows and run the engine's narrow decode step (`Steps.narrow`).
        self._free_slots = list(range(max_num_seqs))
        self._ids = itertools.count() if queue is None else queue._ids
        # Totals since the start: prompt tokens taken from the prefix cache, preemptions.
        self.cached_tokens = 0
        self.preemptions = 0

    @property
    def max_tokens_per_seq(self) -> int:
        return self.pages_per_seq * self.pool.page_size

    def submit(
        self, prompt: Sequence[int], max_new_tokens: int, group: Hashable = None
    ) -> SequenceState:
        """Queue a request, in `group` (by default one of its own); raises `ValueError` if it can
        never fit, `QueueFullError` if the queue holds `max_queue` requests already."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("`prompt` is empty")
        if max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}")
        # The last sampled token is never fed back, so it needs no slot in the cache.
        needed = len(prompt) + max_new_tokens - 1
        limit = min(self.max_tokens_per_seq, self.pool.num_usable * self.pool.page_size)
        if needed > limit:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + `max_new_tokens={max_new_tokens}` needs "
                f"{needed} cache slots; a sequence holds at most {limit} "
                f"({limit // self.pool.page_size} pages of {self.pool.page_size})"
            )
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"the queue holds `max_queue={self.max_queue}` requests already")
        key = next(self._ids)
        seq = SequenceState(key, prompt, max_new_tokens, ("seq", key) if group is None else group)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: SequenceState) -> None:
        """Retire `seq` now, wherever it is, freeing its slot and pages."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "cancelled"
        elif seq.status is Status.RUNNING:
            self._retire(seq, "cancelled")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # Scheduling.

    def _pages_for(self, seq: SequenceState, end: int) -> bool:
        """Give `seq` pages for its tokens up to `end`, preempting newer sequences if needed;
        False if it could only have them by preempting itself."""
        needed = -(-end // self.pool.page_size) - len(seq.pages)
        while needed > self.pool.num_available:
            victim = max(self.running, key=lambda s: s.id)
            if victim is seq:
                return False
            self._preempt(victim)
        if needed > 0:
            seq.pages += self.pool.allocate(needed)
        return True

    def _preempt(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.pool.release(seq.pages)
        heapq.heappush(self._free_slots, seq.slot)
        seq.pages, seq.slot, seq.num_computed, seq.num_cached = [], None, 0, 0
        seq.draft_len = 0
        seq.published = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        self._preempted.append(seq)

    def _admit(self, seq: SequenceState, budget: int, computing: set[int]) -> bool:
        """Start `seq` in a free slot with its cached prefix, if the pages of its first chunk
        are available (a new sequence never preempts the ones that came before it) and no
        other chunk of the step computes its next page (`computing`, their keys)."""
        cached = self.pool.match_prefix(seq.tokens, seq.keys)
        start = len(cached) * self.pool.page_size
        end = min(seq.num_tokens, start + budget)
        pending = len(seq.keys) > len(cached) and seq.keys[len(cached)] in computing
        if pending or -(-end // self.pool.page_size) - len(cached) > self.pool.num_available:
            self.pool.release(cached)
            return False
        seq.pages, seq.num_cached, seq.num_computed = cached, start, start
        seq.published = len(cached)
        self.cached_tokens += start
        seq.slot, seq.shard = heapq.heappop(self._free_slots), self.shard
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def schedule(
        self, max_steps: int = 1, spare: int = 0, width: int | None = None, share: int | None = None
    ) -> Batch:
        """The next step's chunks. Sequences preempted because pages ran out are listed in the
        batch (`preempted`); they are back in the queue, to be computed again. `width` is that
        of the step's prompt chunks, where another shard's chunks have set it, and `share` the
        most sequences this shard runs once it has admitted new ones (`ShardedScheduler`).

        A batch of decode chunks alone runs up to `max_steps` steps (`Batch.steps`): no more
        than any of its sequences has left, and only as many as the free pages allow without
        preempting; report each with `update()` and the chunks of `next_steps()`. Its
        sequences also get pages for `spare` slots past those steps where the free pages
        allow (drafted tokens' keys and values, `jaxlm.speculative`)."""
        self._preempted: list[SequenceState] = []
        self._share = self.max_num_seqs if share is None else share
        self._share_slots()
        chunks: list[Chunk] = []
        decoding = sorted((s for s in self.running if not s.prefilling), key=lambda s: s.id)
        for seq in decoding:
            if seq.status is not Status.RUNNING:
                continue
            if self._pages_for(seq, seq.num_tokens):
                chunks.append(Chunk(seq, seq.num_tokens - 1, (seq.last_token,), True))
            else:
                self._preempt(seq)
        chunks = [c for c in chunks if c.seq.status is Status.RUNNING]
        decodes = len(chunks)
        budget = self.max_num_batched_tokens - decodes
        prefilling = sorted((s for s in self.running if s.prefilling), key=lambda s: s.id)
        # The width of the step's chunks, set by its first of several tokens, and the keys of
        # the pages its chunks fill, which a prompt admitted after them would compute again.
        prefills, computing = 0, set()
        while budget > 0:
            room = self._room(width, prefills)
            cap = min(budget, room or budget)
            if prefilling and room:
                seq = prefilling.pop(0)
                if seq.status is not Status.RUNNING:
                    continue
            elif (seq := self._next_waiting(bool(room))) is not None and self._admit(
                seq, cap, computing
            ):
                self.waiting.remove(seq)
            else:
                break
            end = min(seq.num_tokens, seq.num_computed + cap)
            if not self._pages_for(seq, end):
                self._preempt(seq)
                break
            tokens = tuple(seq.tokens_between(seq.num_computed, end))
            chunks.append(Chunk(seq, seq.num_computed, tokens, end == seq.num_tokens))
            budget -= len(tokens)
            if len(tokens) > 1:
                prefills += 1
                width = width or self._width(len(tokens))
            if self.pool.prefix_cache:
                size = self.pool.page_size
                self._hash(seq, end // size)
                computing.update(seq.keys[seq.num_computed // size : end // size])
        chunks = [c for c in chunks if c.seq.status is Status.RUNNING]
        steps = self._steps(chunks, max_steps, spare) if len(chunks) == decodes else 1
        return Batch(tuple(chunks), tuple(self._preempted), steps, width if prefills else None)

    def _room(self, width: int | None, prefills: int) -> int:
        """The most tokens the step's next chunk may hold, given the width of its chunks of
        several tokens so far and their number; 0 if no chunk of several may join."""
        if self.max_prefill_chunks is not None and prefills >= self.max_prefill_chunks:
            return 0
        if self.chunk_shapes is None:
            return self.max_num_batched_tokens
        if width is None:
            return max(self.chunk_shapes)
        return width if prefills < self.chunk_shapes[width] else 0

    def _width(self, tokens: int) -> int | None:
        """The width a chunk of `tokens` tokens pads to."""
        if self.chunk_shapes is None:
            return None
        return next(w for w in self.chunk_shapes if w >= tokens)

    def _next_waiting(self, prefill: bool) -> SequenceState | None:
        """The waiting sequence to admit next, if a slot is free: the first of those whose group
        runs the fewest sequences; without `prefill`, of those whose prompt is one token."""
        if not self._free_slots or len(self.running) >= self._share:
            return None
        running = collections.Counter(s.group for s in self.running)
        best = None
        for seq in self.waiting:
            if not prefill and len(seq.prompt) + len(seq.output) > 1:
                continue
            # Most often the first waiting sequence's group runs none: the queue is not scanned.
            if not running[seq.group]:
                return seq
            if best is None or running[seq.group] < running[best.group]:
                best = seq
        return best

    def _share_slots(self) -> None:
        """With no slot free, preempt for each group that waits with none running the newest
        sequence of the group that runs the most, while that group runs several."""
        if self._free_slots or not self.waiting:
            return
        running = collections.Counter(s.group for s in self.running)
        starved = {s.group for s in self.waiting if s.group not in running}
        for _ in starved:
            group, count = running.most_common(1)[0]
            if count < 2:
                return
            self._preempt(max((s for s in self.running if s.group == group), key=lambda s: s.id))
            running[group] -= 1

    def _steps(self, chunks: list[Chunk], max_steps: int, spare: int) -> int:
        """How many decode steps `chunks` run in a row, given their pages for all of them, and
        `spare` slots more where the free pages hold them."""
        seqs = [c.seq for c in chunks]
        steps = min([max_steps] + [s.max_new_tokens - len(s.output) for s in seqs])
        if steps <= 1 or not self._reserve(seqs, steps - 1):
            steps = 1
        if spare:
            self._reserve(seqs, steps - 1 + spare)
        return steps

    def _reserve(self, seqs: list[SequenceState], ahead: int) -> bool:
        """Give each of `seqs` pages for `ahead` slots past its last token (within its
        `pages_per_seq`), if the free pages hold them all; whether they did."""
        size = self.pool.page_size
        needed = [
            max(0, min(-(-(s.num_tokens + ahead) // size), self.pages_per_seq) - len(s.pages))
            for s in seqs
        ]
        if sum(needed) > self.pool.num_available:
            return False
        for seq, n in zip(seqs, needed, strict=True):
            if n > 0:
                seq.pages += self.pool.allocate(n)
        return True

    def next_steps(self, batch: Batch) -> Batch:
        """The decode chunks of the step after `batch`'s (one of its `steps`), once `update()` has
        recorded it: the sequences still running, each with the token it sampled last."""
        chunks = (c.seq for c in batch.chunks if c.seq.status is Status.RUNNING)
        return Batch(tuple(Chunk(s, s.num_tokens - 1, (s.last_token,), True) for s in chunks))

    # After the step.

    def update(
        self,
        batch: Batch,
        sampled: dict[int, int],
        stop: dict[int, bool] | None = None,
    ) -> list[SequenceState]:
        """Record a step: `sampled[id]` is the token sampled for each chunk with `sample`, and
        `stop[id]` says whether it ended the sequence (a stop token or string). Returns the
        sequences that finished, whose slots and pages are free again."""
        finished = []
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed = chunk.start + len(chunk.tokens)
            self._publish(seq)
            if not chunk.sample:
                continue
            seq.output.append(sampled[seq.id])
            if stop and stop.get(seq.id):
                self._retire(seq, "stop")
                finished.append(seq)
            elif len(seq.output) >= seq.max_new_tokens:
                self._retire(seq, "length")
                finished.append(seq)
        return finished

    def _publish(self, seq: SequenceState) -> None:
        """Publish the pages `seq` has filled since the last step, each once, hashing only
        those whose keys it has not computed before (a preempted sequence keeps its keys)."""
        if not self.pool.prefix_cache:
            return
        full = seq.num_computed // self.pool.page_size
        self._hash(seq, full)
        for i in range(seq.published, full):
            self.pool.publish(seq.pages[i], seq.keys[i])
        seq.published = max(seq.published, full)

    def _hash(self, seq: SequenceState, pages: int) -> None:
        """Extend `seq.keys` to its first `pages` full pages: each page is hashed once, and a
        preempted sequence keeps its keys."""
        size = self.pool.page_size
        for i in range(len(seq.keys), pages):
            previous = seq.keys[-1] if seq.keys else 0
            seq.keys.append(page_key(previous, seq.tokens_between(i * size, (i + 1) * size)))

    def _retire(self, seq: SequenceState, reason: str) -> None:
        self.running.remove(seq)
        self.pool.release(seq.pages)
        heapq.heappush(self._free_slots, seq.slot)
        seq.pages, seq.slot = [], None
        seq.status, seq.finish_reason = Status.FINISHED, reason
