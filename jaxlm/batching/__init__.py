"""Continuous batching over a paged KV cache: the page pool, the scheduler and the engine."""

from jaxlm.batching.pages import OutOfPagesError, PagePool
from jaxlm.batching.scheduler import Batch, Chunk, QueueFullError, Scheduler, SequenceState, Status

__all__ = [
    "Batch",
    "Chunk",
    "OutOfPagesError",
    "PagePool",
    "QueueFullError",
    "Scheduler",
    "SequenceState",
    "Status",
]
