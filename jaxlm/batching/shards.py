"""An engine's slots split over a mesh's `data` axis: a `Scheduler` for each shard.

Each device (or `model` group of devices) along `data` holds the pages of its own slots, and a
step runs every shard's rows over its own pages (`jaxlm.batching.step`). A sequence runs on one
shard from admission to its end (`SequenceState.shard`); its page numbers are that shard's. The
shards admit from one queue, each up to an even share of the sequences, the one whose prefix
cache holds the most of the next prompt first; a step's prompt chunks share one width across
the shards, the first chunk's.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxlm.batching.pages import PagePool
from jaxlm.batching.scheduler import Batch, Scheduler, SequenceState, Status
from jaxlm.sharding import check_data_divides


class ShardedScheduler:
    """`Scheduler`'s methods over the shards' schedulers, one for each of `pools`, which split
    `max_num_seqs` slots evenly; the other options are each shard's.

    Example:
        >>> pools = [PagePool(17, 16), PagePool(17, 16)]
        >>> scheduler = ShardedScheduler(pools, max_num_seqs=4, max_num_batched_tokens=64)
        >>> a, b = (scheduler.submit([1, 2, 3], max_new_tokens=2) for _ in range(2))
        >>> batch = scheduler.schedule()         # each prompt on a shard of its own
        >>> sorted(c.seq.shard for c in batch.chunks)
        [0, 1]
    """

    def __init__(self, pools: Sequence[PagePool], *, max_num_seqs: int, **options):
        check_data_divides("max_num_seqs", max_num_seqs, len(pools))
        rows = max_num_seqs // len(pools)
        first = Scheduler(pools[0], max_num_seqs=rows, **options)
        self.shards = [first] + [
            Scheduler(pool, max_num_seqs=rows, shard=d, queue=first, **options)
            for d, pool in enumerate(pools[1:], 1)
        ]
        self.waiting = first.waiting
        self.max_tokens_per_seq = first.max_tokens_per_seq

    @classmethod
    def over(cls, pools: Sequence[PagePool], **options) -> Scheduler | ShardedScheduler:
        """The scheduler of `pools`: a `Scheduler` for one, else a `ShardedScheduler`."""
        return Scheduler(pools[0], **options) if len(pools) == 1 else cls(pools, **options)

    @property
    def running(self) -> list[SequenceState]:
        return [s for shard in self.shards for s in shard.running]

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.shards)

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.shards)

    def submit(self, *args, **kwargs) -> SequenceState:
        return self.shards[0].submit(*args, **kwargs)

    def cancel(self, seq: SequenceState) -> None:
        # A waiting sequence is in the queue all shards share.
        self.shards[seq.shard if seq.status is Status.RUNNING else 0].cancel(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.running for s in self.shards)

    def schedule(self, max_steps: int = 1, spare: int = 0) -> Batch:
        """Every shard's chunks in one `Batch`: its decode steps are the fewest any shard runs,
        and one if any shard runs a prompt chunk."""
        # Each shard admits up to its share of the sequences, the one whose pages hold the
        # longest cached prefix of the next in the queue first, then the one running the fewest.
        share = -(-(len(self.waiting) + len(self.running)) // len(self.shards))
        head = self.waiting[0] if self.waiting else None

        def order(shard: Scheduler) -> tuple[int, int]:
            cached = len(shard.pool.cached(head.tokens, head.keys)) if head else 0
            return -cached, len(shard.running)

        width, batches = None, []
        for shard in sorted(self.shards, key=order):
            batches.append(batch := shard.schedule(max_steps, spare, width, share))
            width = width or batch.width
        return Batch(
            tuple(c for b in batches for c in b.chunks),
            tuple(s for b in batches for s in b.preempted),
            min((b.steps for b in batches if b.chunks), default=1),
            width,
        )

    def next_steps(self, batch: Batch) -> Batch:
        return self.shards[0].next_steps(batch)

    def update(self, batch: Batch, sampled: dict[int, int], stop=None) -> list[SequenceState]:
        finished = []
        for d, shard in enumerate(self.shards):
            chunks = tuple(c for c in batch.chunks if c.seq.shard == d)
            if chunks:
                finished += shard.update(Batch(chunks), sampled, stop)
        return finished
