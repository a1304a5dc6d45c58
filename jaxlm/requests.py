"""What a request asks for: `SamplingParams`, checked, and in arrays as a `Request`.

`SamplingParams` is what `generate`, `stream`, `LLMEngine.submit` and the server take; it checks
each value as it is made. `parse_request` turns prompts and their parameters into a `Request`
for a model, or raises a `ValueError` that names the argument and its limit, before any XLA
work.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxlm.batching.sampled import MAX_LOGIT_BIAS, TOP_LOGPROBS
from jaxlm.generator import SAMPLING_FIELDS, STOP_IDS_BUCKET


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


# OpenAI's limits of its penalties and of a `logit_bias` entry.
PENALTY_RANGE = 2.0
BIAS_RANGE = 100.0


def _penalties(
    vocab_size: int | None, presence_penalty, frequency_penalty, logit_bias
) -> tuple[float, float, tuple[tuple[int, float], ...]]:
    """OpenAI's `presence_penalty`, `frequency_penalty` (each in [-2, 2]) and `logit_bias` (token
    ids, or their strings as JSON keys are, to a bias in [-100, 100]) checked; the bias as
    `(token_id, bias)` pairs. Without `vocab_size`, any id >= 0 passes."""
    check = lambda v: math.isfinite(v) and -PENALTY_RANGE <= v <= PENALTY_RANGE
    limit = f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]"
    presence = _per_row("presence_penalty", presence_penalty, 1, 0.0, np.float32, check, limit)
    frequency = _per_row("frequency_penalty", frequency_penalty, 1, 0.0, np.float32, check, limit)
    logit_bias = logit_bias or {}
    if not isinstance(logit_bias, Mapping):
        raise ValueError(f"`logit_bias` must map token ids to numbers, got {logit_bias!r}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"`logit_bias` holds at most {MAX_LOGIT_BIAS} tokens, got {len(logit_bias)}"
        )
    pairs = []
    for key, value in logit_bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
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


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request samples and when it stops: what `generate`, `stream`, `LLMEngine.submit`
    and the server take (or build from their keyword arguments). Each value is checked here.

    `temperature=0` is greedy; `top_k`, `top_p`, `min_p` and `repetition_penalty` filter the
    sampled distribution (Hugging Face conventions; None: off); for `generate` and `stream`,
    each is a number or one number per prompt. `presence_penalty`, `frequency_penalty` (over
    the tokens generated, in [-2, 2]) and `logit_bias` (`{token_id: bias in [-100, 100]}`) are
    OpenAI's. A request stops at `stop_token_ids` (None: the model's EOS tokens; `[]`: none),
    at `stop` strings (the text is cut before them) or after `max_new_tokens`. `seed` keys the
    sampling: the same seed, the same tokens. `logprobs=k` records each token's log-probability
    and the `k` (at most `TOP_LOGPROBS`) most likely tokens' at its step. `response_format` holds
    the output to a grammar: OpenAI's `{"type": "json_object"}` or `{"type": "json_schema",
    ...}`, a Pydantic model class or a `jaxlm.constrain.Grammar`; the request stops (`"stop"`)
    when the grammar is complete.

    Example:
        >>> params = jaxlm.SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1)
        >>> jaxlm.generate(model, tokenizer, "Once upon a time", params)[0].text
    """

    max_new_tokens: int
    temperature: float | Sequence[float] = 0.0
    top_k: int | Sequence[int] | None = None
    top_p: float | Sequence[float] | None = None
    min_p: float | Sequence[float] | None = None
    repetition_penalty: float | Sequence[float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int = 0
    stop_token_ids: Sequence[int] | None = None
    stop: str | Sequence[str] | None = None
    logprobs: int | None = None
    response_format: object = None

    def __post_init__(self):
        max_new = self.max_new_tokens
        if not is_int(max_new) or max_new < 1:
            raise ValueError(f"`max_new_tokens` must be an integer >= 1, got {max_new!r}")
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            n = len(value) if isinstance(value, Sequence | np.ndarray) else 1
            _per_row(name, value, n, *_CHECKS[name])
        _penalties(None, self.presence_penalty, self.frequency_penalty, self.logit_bias)
        if not is_int(self.seed):
            raise ValueError(f"`seed` must be an integer, got {self.seed!r}")
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, Sequence | np.ndarray) or not all(is_int(t) for t in ids)
        ):
            raise ValueError(f"`stop_token_ids` must be a list of token ids, got {ids!r}")
        stop = self.stop
        if stop is not None and not isinstance(stop, str | Sequence):
            raise ValueError(f"`stop` must be a non-empty string or a list of them, got {stop!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("`stop` must be a non-empty string or a list of them")
        k = self.logprobs
        if k is not None and (not is_int(k) or not 0 <= k <= TOP_LOGPROBS):
            raise ValueError(f"`logprobs` must be an integer in [0, {TOP_LOGPROBS}], got {k!r}")


def sampling_params(params: SamplingParams | None, fields: dict) -> SamplingParams:
    """`params` with `fields` (its fields by name) in their place; without `params`, a
    `SamplingParams` of the fields alone."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        names = ", ".join(f"`{n}`" for n in unknown)
        raise TypeError(f"unexpected argument {names}: not a field of `jaxlm.SamplingParams`")
    if params is None:
        return SamplingParams(**fields)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"`params` must be a `jaxlm.SamplingParams`, got {type(params).__name__}")
    return dataclasses.replace(params, **fields) if fields else params


@dataclasses.dataclass
class Request:
    """Prompts as token ids and their `params`, checked against a model: per-row sampling
    arrays, padded stop ids, stop strings and `logit_bias` as `(token_id, bias)` pairs."""

    prompts: list[list[int]]
    single: bool
    params: SamplingParams
    sampling: dict[str, np.ndarray]
    stop_ids: np.ndarray
    stop: tuple[str, ...]
    logit_bias: tuple[tuple[int, float], ...]

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    def bias_row(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as a step takes it: `MAX_LOGIT_BIAS` token ids (`vocab_size` past the
        last: none) and their biases."""
        ids = np.full((MAX_LOGIT_BIAS,), vocab_size, np.int32)
        bias = np.zeros((MAX_LOGIT_BIAS,), np.float32)
        for j, (token, value) in enumerate(self.logit_bias):
            ids[j], bias[j] = token, value
        return ids, bias


def parse_request(model, tokenizer, prompts, params: SamplingParams, plan=None) -> Request:
    """The `Request` of `prompts` under `params` for `model`; with a `plan`, the model's
    context is the plan's to check."""
    ids, single = _prompt_ids(tokenizer, prompts)
    vocab = model.config.vocab_size
    for i, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad}")
    n = len(ids)
    sampling = {
        name: _per_row(name, getattr(params, name), n, *_CHECKS[name]) for name in SAMPLING_FIELDS
    }
    stop_ids = params.stop_token_ids
    if stop_ids is None:
        stop_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        stop_ids = stop_ids or model.config.eos_token_id
    stop_ids = [int(t) for t in stop_ids]
    if any(not 0 <= t < vocab for t in stop_ids):
        raise ValueError(f"`stop_token_ids` must be in [0, {vocab}), got {stop_ids}")
    size = STOP_IDS_BUCKET * max(1, math.ceil(len(stop_ids) / STOP_IDS_BUCKET))
    padded = np.full((size,), -1, np.int32)
    padded[: len(stop_ids)] = stop_ids
    stop = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ())
    if stop and tokenizer is None:
        raise ValueError("`stop` strings need a tokenizer")
    *_, bias = _penalties(vocab, 0.0, 0.0, params.logit_bias)
    max_new = params.max_new_tokens
    longest, context = max(len(p) for p in ids), model.config.max_position_embeddings
    if plan is None and longest + max_new > context:
        # Without a plan, the request would size its own cache: refuse it before planning.
        raise ValueError(
            f"prompt of {longest} tokens + `max_new_tokens={max_new}` exceeds the model's "
            f"`max_position_embeddings={context}`; pass a `plan` to go beyond it"
        )
    return Request(ids, single, params, sampling, padded, stop, bias)
