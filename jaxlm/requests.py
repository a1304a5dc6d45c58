"""A generation request checked and in arrays, and its text cut at stop strings.

`parse_request` turns the arguments of `generate` and `stream` into a `Request`, or raises a
`ValueError` that names the argument and its limit before any XLA work; `Detokenizer` releases
a growing list of ids as text once it is final.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxlm.engine import SAMPLING_FIELDS, STOP_IDS_BUCKET


@dataclasses.dataclass
class Request:
    """A checked request: token ids per prompt, per-row sampling arrays, padded stop ids."""

    prompts: list[list[int]]
    single: bool
    max_new_tokens: int
    sampling: dict[str, np.ndarray]
    stop_ids: np.ndarray
    stop: tuple[str, ...]
    seed: int
    # OpenAI's penalties and `logit_bias` as `(token_id, bias)` pairs, which `LLMEngine` takes.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()


def _per_row(name: str, value, n: int, default, dtype, check, limit: str) -> np.ndarray:
    values = [value] * n if value is None or np.isscalar(value) else list(value)
    if len(values) != n:
        raise ValueError(f"`{name}` has {len(values)} values for {n} prompts")
    out = []
    for v in values:
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, int | float | np.number):
            raise ValueError(f"`{name}` must be a number, got {v!r}")
        try:
            ok = check(v)
        except OverflowError:
            # An integer beyond float range, which no check accepts.
            ok = False
        if not ok:
            raise ValueError(f"`{name}` {limit}, got {v!r}")
        out.append(v)
    return np.asarray(out, dtype)


# Per sampling parameter: the value that turns it off, its dtype, its check and the limit a
# failed check names.
_CHECKS = {
    "temperature": (
        0.0,
        np.float32,
        lambda v: math.isfinite(v) and v >= 0,
        "must be a finite number >= 0",
    ),
    "top_k": (
        0,
        np.int32,
        lambda v: float(v).is_integer() and 0 <= v < 2**31,
        "must be an integer >= 0 (0 or None: off)",
    ),
    "top_p": (1.0, np.float32, lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "min_p": (0.0, np.float32, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "repetition_penalty": (
        1.0,
        np.float32,
        lambda v: math.isfinite(v) and v > 0,
        "must be a finite number > 0",
    ),
}


def check_sampling(**values) -> None:
    """Check sampling parameters by name as `parse_request` does, before any model exists: the
    command line refuses `--top-p 2` before it loads anything."""
    for name, value in values.items():
        _per_row(name, value, 1, *_CHECKS[name])


# OpenAI's limits of its penalties and of a `logit_bias` entry; the most entries of a request's
# `logit_bias`, which a step takes as a fixed-shape list of ids and values.
PENALTY_RANGE = 2.0
BIAS_RANGE = 100.0
MAX_LOGIT_BIAS = 300


def check_penalties(
    vocab_size: int, presence_penalty, frequency_penalty, logit_bias
) -> tuple[float, float, tuple[tuple[int, float], ...]]:
    """OpenAI's `presence_penalty`, `frequency_penalty` (each in [-2, 2]) and `logit_bias` (token
    ids, or their strings as JSON keys are, to a bias in [-100, 100]) checked; the bias as
    `(token_id, bias)` pairs."""
    check = lambda v: math.isfinite(v) and -PENALTY_RANGE <= v <= PENALTY_RANGE
    limit = f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]"
    presence = _per_row("presence_penalty", presence_penalty, 1, 0.0, np.float32, check, limit)
    frequency = _per_row("frequency_penalty", frequency_penalty, 1, 0.0, np.float32, check, limit)
    logit_bias = logit_bias or {}
    if not isinstance(logit_bias, dict):
        raise ValueError(f"`logit_bias` must map token ids to numbers, got {logit_bias!r}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"`logit_bias` holds at most {MAX_LOGIT_BIAS} tokens, got {len(logit_bias)}"
        )
    pairs = []
    for key, value in logit_bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(
                f"`logit_bias` keys must be token ids in [0, {vocab_size}), got {key!r}"
            )
        bias = _per_row(
            "logit_bias",
            value,
            1,
            0.0,
            np.float32,
            lambda v: -BIAS_RANGE <= v <= BIAS_RANGE,
            f"values must be in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}]",
        )
        pairs.append((int(token), float(bias[0])))
    return float(presence[0]), float(frequency[0]), tuple(pairs)


def _prompt_ids(tokenizer, prompts) -> tuple[list[list[int]], bool]:
    if isinstance(prompts, bytes | bytearray) or not isinstance(
        prompts, str | Sequence | np.ndarray
    ):
        raise ValueError(
            "`prompts` must be a string, a list of token ids or a list of such, "
            f"got {type(prompts).__name__}"
        )
    single = isinstance(prompts, str) or (
        isinstance(prompts, Sequence | np.ndarray) and len(prompts) > 0 and is_int(prompts[0])
    )
    items = [prompts] if single else list(prompts)
    if not items:
        raise ValueError("`prompts` is empty")
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            ids = tokenizer.encode(p)
        elif isinstance(p, Sequence | np.ndarray) and all(is_int(t) for t in p):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} must be a string or a list of token ids")
        if not ids:
            raise ValueError(f"prompt {i} is empty (no tokens)")
        out.append(ids)
    return out, single


def is_int(x) -> bool:
    """Whether `x` is an integer (a Python or NumPy one, not a bool)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def parse_request(model, tokenizer, prompts, **kw) -> Request:
    """The `Request` of `generate`'s or `stream`'s arguments (`kw` holds them all, by name)."""
    ids, single = _prompt_ids(tokenizer, prompts)
    vocab = model.config.vocab_size
    for i, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad}")
    max_new = kw["max_new_tokens"]
    if not is_int(max_new) or max_new < 1:
        raise ValueError(f"`max_new_tokens` must be an integer >= 1, got {max_new!r}")
    n = len(ids)
    sampling = {name: _per_row(name, kw[name], n, *_CHECKS[name]) for name in SAMPLING_FIELDS}
    stop_ids = kw["stop_token_ids"]
    if stop_ids is None:
        stop_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        stop_ids = stop_ids or model.config.eos_token_id
    if not isinstance(stop_ids, Sequence | np.ndarray) or not all(is_int(t) for t in stop_ids):
        raise ValueError(f"`stop_token_ids` must be a list of token ids, got {stop_ids!r}")
    stop_ids = [int(t) for t in stop_ids]
    if any(not 0 <= t < vocab for t in stop_ids):
        raise ValueError(f"`stop_token_ids` must be in [0, {vocab}), got {stop_ids}")
    size = STOP_IDS_BUCKET * max(1, math.ceil(len(stop_ids) / STOP_IDS_BUCKET))
    padded = np.full((size,), -1, np.int32)
    padded[: len(stop_ids)] = stop_ids
    stop = kw["stop"]
    if stop is not None and not isinstance(stop, str | Sequence):
        raise ValueError(f"`stop` must be a non-empty string or a list of them, got {stop!r}")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError("`stop` must be a non-empty string or a list of them")
    if stop and tokenizer is None:
        raise ValueError("`stop` strings need a tokenizer")
    seed = kw["seed"]
    if not is_int(seed):
        raise ValueError(f"`seed` must be an integer, got {seed!r}")
    longest, context = max(len(p) for p in ids), model.config.max_position_embeddings
    if kw["plan"] is None and longest + max_new > context:
        # Without a plan, the request would size its own cache: refuse it before planning.
        raise ValueError(
            f"prompt of {longest} tokens + `max_new_tokens={max_new}` exceeds the model's "
            f"`max_position_embeddings={context}`; pass a `plan` to go beyond it"
        )
    return Request(ids, single, max_new, sampling, padded, stop, int(seed))


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
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid])) <= at:
            lo = mid
        else:
            hi = mid - 1
    return text[:at], ids[:lo], True


class Detokenizer:
    """Text of a growing list of ids, released only when it is final.

    Text ending in an incomplete UTF-8 sequence (U+FFFD) or in what could begin a stop string
    is held back until the next tokens settle it. Each update looks for a stop string only
    where it could newly end, in the last `len(stop)` characters before the new text and the
    new text itself, so that long outputs and long stop strings cost no more per token.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.sent = 0
        self.finished = False
        # Characters of the text searched for every stop string already.
        self.searched = 0

    def update(self, ids: list[int], final: bool) -> str:
        if self.finished:
            return ""
        text = self.tokenizer.decode(ids)
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
        return piece

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
