"""What a request gives back, the same from `generate`, `stream` and `LLMEngine`.

`RequestOutput` is a finished request; `Delta` is what `stream` and an engine's handle hand out
as tokens arrive. `Progress` makes both from a request's growing list of token ids: text is
released only once final (`Detokenizer`) and cut before the first stop string (`cut_at_stop`).
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the `top` most likely tokens' at its step as
    `(token_id, logprob)` pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class RequestOutput:
    """A finished request, without its prompt.

    `text` is None without a tokenizer. `finish_reason` is `"stop"` (a stop token, a stop string
    or a complete grammar ended it), `"length"` (it reached `max_new_tokens`) or `"cancelled"`;
    stop tokens and stop strings are not part of the output. With `logprobs=`, one
    `TokenLogprob` per token. With drafts (`speculative=`), the tokens drafted and those of them
    kept.
    """

    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclasses.dataclass
class Delta:
    """What a request produced since the last delta: new text, its tokens (each goes out with
    the last of its text) and their log-probabilities (None unless asked for); the last delta
    carries the `finish_reason`."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


class Progress:
    """One request's output as its tokens arrive: the deltas to hand out, then its result."""

    def __init__(self, tokenizer, stop: tuple[str, ...], prompt: list[int]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.prompt = prompt
        self.detokenizer = Detokenizer(tokenizer, stop) if tokenizer is not None else None
        self.sent = 0  # tokens handed out in deltas so far
        self.result: RequestOutput | None = None

    def update(self, ids: list[int], finished: bool, reason: str, logprobs=None) -> Delta | None:
        """The delta of `ids`, every token so far (stop tokens left out), or None when no text
        is final yet; once `finished` (with `reason`) or cut by a stop string, `result` is set.
        `logprobs` are the tokens' so far, when asked for."""
        if self.result is not None:
            return None
        if self.detokenizer is None:
            piece, ended = "", finished
        else:
            piece = self.detokenizer.update(ids, final=finished)
            ended = finished or self.detokenizer.finished
        if ended:
            text, ids, cut = cut_at_stop(self.tokenizer, ids, self.stop)
            reason = "stop" if cut else reason
            kept = None if logprobs is None else logprobs[: len(ids)]
            self.result = RequestOutput(text, ids, reason, self.prompt, kept)
        end = len(ids)
        if not ended and self.detokenizer is not None and self.detokenizer.held:
            # A token goes out with the last of its text, which a stop string may yet cut.
            end = self.detokenizer.tokens_within(ids, self.sent)
        new = ids[self.sent : end]
        if not ended and not piece and (self.detokenizer is not None or not new):
            return None
        kept = None if logprobs is None else logprobs[self.sent : end]
        self.sent = max(self.sent, end)
        return Delta(piece, new, kept, reason if ended else None)


def find_stop(text: str, stop: tuple[str, ...]) -> int:
    """Where the first of the `stop` strings begins in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else -1


def cut_at_stop(
    tokenizer, ids: list[int], stop: tuple[str, ...]
) -> tuple[str | None, list[int], bool]:
    """Text and ids before the first stop string; ids keep only tokens wholly before it."""
    if tokenizer is None:
        return None, ids, False
    text = tokenizer.decode(ids)
    at = find_stop(text, stop) if stop else -1
    if at < 0:
        return text, ids, False
    return text[:at], ids[: _tokens_within(tokenizer, ids, at)], True


def _tokens_within(tokenizer, ids: list[int], chars: int, lo: int = 0) -> int:
    """How many of the first `ids` (at least `lo`) decode to at most `chars` characters."""
    hi = len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid])) <= chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Updates whose ends a detokenizer keeps, to find the tokens of text held back over as many.
MARKS = 8


class Detokenizer:
    """Text of a growing list of ids, released only when it is final.

    Text ending in an incomplete UTF-8 sequence (U+FFFD) or in what could begin a stop string
    is held back until the next tokens settle it. Each update decodes only its new tokens and
    those of the update before (more while a character is incomplete), and looks for a stop
    string only where it could newly end, in the last `len(stop)` characters before the new
    text and the new text itself, so that long outputs and long stop strings cost no more per
    token (see `docs/performance.md`, "Detokenizing as tokens arrive").
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.sent = 0
        self.finished = False
        # Whether the text's last characters are held back.
        self.held = False
        # Characters of the text searched for every stop string already.
        self.searched = 0
        self._restart()

    def _restart(self) -> None:
        # The last updates' ends whose text is complete: (tokens, characters of their text).
        self._marks = collections.deque([(0, 0)], maxlen=MARKS)
        # The text of the ids to the last end, and that of the ids between the last two ends
        # decoded alone: what later tokens add to the latter is what they add to the whole (a
        # tokenizer may drop the leading space of the first token it decodes, the same in both).
        self._text, self._window = "", ""

    def _decode(self, ids: list[int]) -> str:
        """The text of `ids`, which extend the last `ids` given."""
        start, read = self._marks[-2][0] if len(self._marks) > 1 else 0, self._marks[-1][0]
        tail = self.tokenizer.decode(ids[start:])
        if len(ids) < read or not tail.startswith(self._window):
            # Not a continuation of what was decoded: decode it all, and go on from there.
            self._restart()
            read, tail = 0, self.tokenizer.decode(ids)
        text = self._text + tail[len(self._window) :]
        if not text.endswith("\ufffd") and len(ids) > read:
            self._marks.append((len(ids), len(text)))
            self._text, self._window = text, self.tokenizer.decode(ids[read:])
        return text

    def update(self, ids: list[int], final: bool) -> str:
        if self.finished:
            return ""
        text = self._decode(ids)
        at = self._find(text)
        # Trailing U+FFFD may become another character once more bytes arrive: search it again.
        settled = len(text.rstrip("\ufffd"))
        self.searched = settled
        if at >= 0:
            self.finished = True
            end = at
        elif final:
            self.finished = True
            end = len(text)
        else:
            end = min([settled] + [settled - _held(text, settled, s) for s in self.stop])
        piece = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        self.held = self.sent < len(text)
        return piece

    def tokens_within(self, ids: list[int], lo: int) -> int:
        """How many of `ids`, the last given, at least `lo`, decode to no more than the text
        released. Where `lo` is past two of the last updates' ends, the tokens from the first
        of them on are decoded, not all."""
        marks = [m for m in self._marks if m[0] <= lo][-2:]
        if len(marks) < 2:
            return _tokens_within(self.tokenizer, ids, self.sent, lo)
        (start, _), (read, chars) = marks
        # What `ids[read:k]` add to the text is what they add to that of `ids[start:read]`.
        window = ids[start:]
        known = len(self.tokenizer.decode(window[: read - start]))
        end = _tokens_within(self.tokenizer, window, self.sent - chars + known, lo - start)
        return start + end

    def _find(self, text: str) -> int:
        hits = [text.find(s, max(0, self.searched - len(s))) for s in self.stop]
        hits = [i for i in hits if i >= 0]
        return min(hits) if hits else -1


def _held(text: str, end: int, stop: str) -> int:
    """The length of the longest end of `text[:end]` that begins `stop` without being all of it."""
    at = max(0, end - len(stop) + 1)
    while (at := text.find(stop[0], at, end)) >= 0:
        if stop.startswith(text[at:end]):
            return end - at
        at += 1
    return 0
