"""Continuous batching over a paged KV cache: the page pool and the scheduler."""

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
