"""What a request submitted to `LLMEngine` gives back: its handle, its deltas, its result.

The engine's thread hands each handle its new tokens; the handle turns them into text at stop
strings and wakes whoever waits on it (an iteration, `result()`, or an event loop through
`on_update`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from jaxlm.batching.scheduler import SequenceState
from jaxlm.outputs import Delta, Progress, RequestOutput, TokenLogprob


class RequestHandle:
    """A submitted request: iterate it for its output as it is generated, or wait for `result()`.

    Example:
        >>> handle = engine.submit("Once upon a time", max_new_tokens=32)
        >>> for delta in handle:
        ...     print(delta.text, end="")
        >>> handle.result().finish_reason

    A program on an event loop passes `on_update` to `submit` instead: the engine's thread calls
    it whenever there is something new, and `deltas()` takes it without waiting.
    """

    def __init__(self, engine, seq: SequenceState, req, tokenizer, on_update):
        self._engine = engine
        self.seq = seq
        self._req = req
        self._progress = Progress(tokenizer, req.stop, list(seq.prompt))
        # Every delta so far: every iteration of the handle reads them from the start.
        self._history: list[Delta] = []
        self._changed = threading.Condition()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._on_update = on_update
        self._deltas: list[Delta] = []  # not yet taken by `deltas()`
        self._top = req.params.logprobs
        # The request's place in its grammar (`jaxlm.constrain.Matcher`), set by the engine.
        self._matcher = None
        # Whether the request drafts tokens (`LLMEngine.submit`'s `speculative`).
        self._drafts = False
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.logprobs: list[TokenLogprob] | None = None if self._top is None else []
        # When each token arrived (`time.perf_counter()`), for latency figures.
        self.token_times: list[float] = []

    def _tokens(self) -> list[int]:
        ids = list(self.seq.output)
        if ids and ids[-1] in self._req.stop_ids:
            ids.pop()
        return ids

    def _add_logprobs(self, chosen, ids, top) -> None:
        pairs = tuple(zip(ids[: self._top].tolist(), top[: self._top].tolist(), strict=True))
        self.logprobs.append(TokenLogprob(self.seq.output[-1], float(chosen), pairs))

    def _step(self, finished: bool) -> bool:
        """Take the sequence's new tokens; whether a stop string ended it."""
        progress = self._progress
        delta = progress.update(self._tokens(), finished, self.seq.finish_reason, self.logprobs)
        if delta is not None:
            with self._changed:
                self._history.append(delta)
                self._deltas.append(delta)
                self._changed.notify_all()
        if progress.result is not None:
            progress.result.drafted_tokens = self.drafted_tokens
            progress.result.accepted_tokens = self.accepted_tokens
            self._set_done()
        if delta is not None and self._on_update is not None:
            self._on_update()
        return progress.result is not None and not finished

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._set_done()
        if self._on_update is not None:
            self._on_update()

    def _set_done(self) -> None:
        with self._changed:
            self._done.set()
            self._changed.notify_all()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def deltas(self) -> list[Delta]:
        """What the request produced since the last call, without waiting; once `done`, the
        `result()` follows the last of them."""
        with self._engine._lock:
            out, self._deltas = self._deltas, []
        return out

    def __iter__(self) -> Iterator[Delta]:
        """The output, delta by delta as it is generated (the last carries the
        `finish_reason`); from the start on every iteration, so that a notebook cell run again
        prints it again."""
        sent = 0
        while True:
            with self._changed:
                while len(self._history) == sent and not self._done.is_set():
                    self._changed.wait()
                new, done = self._history[sent:], self._done.is_set()
            yield from new
            sent += len(new)
            if done and sent == len(self._history):
                break
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._progress.result

    def cancel(self) -> None:
        """Stop the request at the next step; its slot and pages are freed."""
        self._engine._cancel(self)
