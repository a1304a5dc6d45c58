"""`LLMEngine` across processes: every process runs the same steps, and process 0 says which.

On a mesh whose devices span several processes (`jax.distributed`), each step is one program
of all of them: every process must call it, with the same inputs, in the same order. Process 0
takes the requests. At each call boundary it hands the others what changed since the last one
(requests submitted or cancelled, the engine closed) as one small host array broadcast to all;
each replays it on its own scheduler. From the same events and the same sampled tokens (every
process reads the step's replicated output), every scheduler makes the same batches.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Hashable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxlm.requests import SamplingParams

# Bytes a broadcast carries: a payload goes in as many of them as it needs, so that one small
# executable broadcasts every payload and serving compiles nothing.
CHUNK = 4096
# Seconds between process 0's broadcasts while it has nothing to say: the others wait for it
# inside a collective, which XLA fails after its own timeout.
HEARTBEAT = 1.0


@dataclasses.dataclass(frozen=True)
class Submit:
    """A request process 0 took: its prompt's token ids and what `LLMEngine.submit` was given
    (a grammar, not a class only process 0 may define, as `params.response_format`), and
    whether it drafts."""

    prompt: list[int]
    params: SamplingParams
    group: Hashable
    drafts: bool


@dataclasses.dataclass(frozen=True)
class Cancel:
    """A request cancelled on process 0: its sequence's id."""

    seq_id: int


@dataclasses.dataclass(frozen=True)
class Close:
    """Process 0 closed the engine."""


def spans_processes(mesh) -> bool:
    """Whether `mesh` (or None) holds devices of other processes than this one."""
    return mesh is not None and any(
        d.process_index != jax.process_index() for d in mesh.devices.flat
    )


def exchange(events: list) -> list:
    """Process 0's `events`, on every process (the others pass an empty list)."""
    data = None
    if jax.process_index() == 0:
        payload = pickle.dumps(events)
        data = np.frombuffer(len(payload).to_bytes(8, "little") + payload, np.uint8)
    # The first chunk carries the payload's size: a call's few events take one broadcast.
    first = _broadcast(_chunk(data, 0))
    size = int.from_bytes(first[:8].tobytes(), "little")
    chunks = [first, *(_broadcast(_chunk(data, start)) for start in range(CHUNK, size + 8, CHUNK))]
    # Process 0's own pickle, which only it could have sent.
    return pickle.loads(np.concatenate(chunks)[8 : 8 + size].tobytes())


def _chunk(data: np.ndarray | None, start: int) -> np.ndarray:
    chunk = np.zeros(CHUNK, np.uint8)
    if data is not None:
        piece = data[start : start + CHUNK]
        chunk[: piece.size] = piece
    return chunk


def _broadcast(x: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.broadcast_one_to_all(x))
