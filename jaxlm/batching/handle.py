"""What a request submitted to `LLMEngine` gives back: its handle, its deltas, its result.

The engine's thread hands each handle its new tokens; the handle turns them into text at stop
strings and wakes whoever waits on it (an iteration, `result()`, or an event loop through
`on_update`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

from jaxlm.batching.scheduler import SequenceState
from jaxlm.requests import Detokenizer, cut_at_stop


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the `top` most likely tokens' at its step as
    `(token_id, logprob)` pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its text (None without a tokenizer), token ids and why it ended
    (`"stop"`, `"length"` or `"cancelled"`); with `logprobs=` at submit, one `TokenLogprob` per
    token."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Delta:
    """What a request produced since the last `RequestHandle.deltas()`: new text, the tokens
    sampled meanwhile and their log-probabilities (None unless asked for)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


class RequestHandle:
    """A submitted request: iterate it for its text as it is generated, or wait for `result()`.

    Example:
        >>> handle = engine.submit("Once upon a time", max_new_tokens=32)
        >>> for piece in handle:
        ...     print(piece, end="")
        >>> handle.result().finish_reason

    A program on an event loop passes `on_update` to `submit` instead: the engine's thread calls
    it whenever there is something new, and `deltas()` takes it without waiting.
    """

    def __init__(self, engine, seq: SequenceState, req, tokenizer, top_logprobs, on_update):
        self._engine = engine
        self.seq = seq
        self._req = req
        self._tokenizer = tokenizer
        # The text so far, piece by piece: every iteration of the handle reads it from the start.
        self._pieces: list[str] = []
        self._changed = threading.Condition()
        self._detokenizer = Detokenizer(tokenizer, req.stop) if tokenizer is not None else None
        self._done = threading.Event()
        self._result: RequestOutput | None = None
        self._error: BaseException | None = None
        self._on_update = on_update
        self._deltas: list[Delta] = []
        self._sent = 0  # tokens handed out in deltas so far
        self._top = top_logprobs
        # The request's place in its grammar (`jaxlm.constrain.Matcher`), set by the engine.
        self._matcher = None
        # Whether the request drafts tokens (`LLMEngine.submit`'s `speculative`).
        self._drafts = False
        self.logprobs: list[TokenLogprob] | None = None if top_logprobs is None else []
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
        ids = self._tokens()
        if self._detokenizer is None:
            self._emit("", ids)
            if finished:
                self._finish(None, ids, self.seq.finish_reason)
            return False
        piece = self._detokenizer.update(ids, final=finished)
        if piece:
            with self._changed:
                self._pieces.append(piece)
                self._changed.notify_all()
        stopped = self._detokenizer.finished and not finished
        if finished or stopped:
            text, ids, cut = cut_at_stop(self._tokenizer, ids, self._req.stop)
            self._emit(piece, ids)
            self._finish(text, ids, "stop" if cut or stopped else self.seq.finish_reason)
        elif piece:
            self._emit(piece, ids)
        return stopped

    def _emit(self, text: str, ids: list[int]) -> None:
        new = ids[self._sent :]
        if not text and not new:
            return
        logprobs = None if self.logprobs is None else self.logprobs[self._sent : len(ids)]
        self._deltas.append(Delta(text, new, logprobs))
        self._sent = max(self._sent, len(ids))
        if self._on_update is not None:
            self._on_update()

    def _finish(self, text, ids, reason) -> None:
        logprobs = None if self.logprobs is None else self.logprobs[: len(ids)]
        self._result = RequestOutput(text, ids, reason, list(self.seq.prompt), logprobs)
        self._set_done()
        if self._on_update is not None:
            self._on_update()

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

    def __iter__(self) -> Iterator[str]:
        """The text, piece by piece as it is generated; from the start on every iteration, so
        that a notebook cell run again prints it again."""
        sent = 0
        while True:
            with self._changed:
                while len(self._pieces) == sent and not self._done.is_set():
                    self._changed.wait()
                new, done = self._pieces[sent:], self._done.is_set()
            yield from new
            sent += len(new)
            if done and sent == len(self._pieces):
                break
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Stop the request at the next step; its slot and pages are freed."""
        self._engine._cancel(self)
