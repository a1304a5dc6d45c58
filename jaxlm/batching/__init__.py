"""Continuous batching over a paged KV cache: the page pool, the schedulers and the engine."""

from jaxlm.batching.pages import OutOfPagesError, PagePool
from jaxlm.batching.scheduler import Batch, Chunk, QueueFullError, Scheduler, SequenceState, Status
from jaxlm.batching.shards import ShardedScheduler

__all__ = [
    "Batch",
    "Chunk",
    "OutOfPagesError",
    "PagePool",
    "QueueFullError",
    "Scheduler",
    "SequenceState",
    "ShardedScheduler",
    "Status",
]
