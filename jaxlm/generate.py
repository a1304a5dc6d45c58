"""`generate`, `stream` and `chat`: the whole generation inside XLA.

`generate` makes one jitted call per request: prefill of the whole batch, then a
`lax.while_loop` that decodes, samples and checks stop tokens until every row is done. Python is
not involved per token, so the calling thread holds no GIL while the model runs. `stream` runs
the same loop in chunks of a few tokens per call, with the scratch donated from call to call.

Shapes are bucketed so that new requests rarely compile:
- the batch is padded to a power of two (1, 2, 4, 8, ...) rows;
- prompts are left-padded to a power of two of at least 16 tokens (16, 32, 64, ...), and
  prompts longer than the plan's prefill chunk to a multiple of it;
- `max_new_tokens` is rounded up to a power of two of at least 16 for the size of the cache;
  the loop itself stops at the exact number asked for, which is a traced value;
- sampling parameters are traced per-row values: changing them never compiles.
Without a `plan`, one is made for the bucketed shape (batch, prompt + new tokens) and cached on
the model for later requests of the same shape.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxlm.engine import DEFAULT_PREFILL_CHUNK, SAMPLING_FIELDS, STOP_IDS_BUCKET, engine_of
from jaxlm.errors import PlanError
from jaxlm.planner import Plan, plan

MIN_PROMPT_BUCKET = 16
MIN_NEW_TOKENS_BUCKET = 16
STREAM_CHUNK = 8


def bucket(n: int, minimum: int) -> int:
    """The power of two >= `n`, at least `minimum`."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@dataclasses.dataclass
class GenerationResult:
    """What `generate` returns: one entry per prompt, without the prompt.

    `finish_reasons[i]` is `"stop"` (a stop token or stop string ended row `i`) or `"length"`
    (it reached `max_new_tokens`). Stop tokens and stop strings are not part of the output.
    """

    texts: list[str | None]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_token_ids: list[list[int]]


@dataclasses.dataclass
class _Request:
    prompts: list[list[int]]
    single: bool
    max_new_tokens: int
    sampling: dict[str, np.ndarray]
    stop_ids: np.ndarray
    stop: tuple[str, ...]
    seed: int


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


def _prompt_ids(tokenizer, prompts) -> tuple[list[list[int]], bool]:
    if isinstance(prompts, bytes | bytearray) or not isinstance(
        prompts, str | Sequence | np.ndarray
    ):
        raise ValueError(
            "`prompts` must be a string, a list of token ids or a list of such, "
            f"got {type(prompts).__name__}"
        )
    single = isinstance(prompts, str) or (
        isinstance(prompts, Sequence | np.ndarray) and len(prompts) > 0 and _is_int(prompts[0])
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
        elif isinstance(p, Sequence | np.ndarray) and all(_is_int(t) for t in p):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} must be a string or a list of token ids")
        if not ids:
            raise ValueError(f"prompt {i} is empty (no tokens)")
        out.append(ids)
    return out, single


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _request(model, tokenizer, prompts, **kw) -> _Request:
    ids, single = _prompt_ids(tokenizer, prompts)
    vocab = model.config.vocab_size
    for i, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad}")
    max_new = kw["max_new_tokens"]
    if not _is_int(max_new) or max_new < 1:
        raise ValueError(f"`max_new_tokens` must be an integer >= 1, got {max_new!r}")
    n = len(ids)
    sampling = {name: _per_row(name, kw[name], n, *_CHECKS[name]) for name in SAMPLING_FIELDS}
    stop_ids = kw["stop_token_ids"]
    if stop_ids is None:
        stop_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        stop_ids = stop_ids or model.config.eos_token_id
    if not isinstance(stop_ids, Sequence | np.ndarray) or not all(_is_int(t) for t in stop_ids):
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
    if not _is_int(seed):
        raise ValueError(f"`seed` must be an integer, got {seed!r}")
    longest, context = max(len(p) for p in ids), model.config.max_position_embeddings
    if kw["plan"] is None and longest + max_new > context:
        # Without a plan, the request would size its own cache: refuse it before planning.
        raise ValueError(
            f"prompt of {longest} tokens + `max_new_tokens={max_new}` exceeds the model's "
            f"`max_position_embeddings={context}`; pass a `plan` to go beyond it"
        )
    return _Request(ids, single, max_new, sampling, padded, stop, int(seed))


def _shapes(req: _Request, given: Plan | None, data: int = 1) -> tuple[int, int, int, int]:
    """(batch rows, prompt length, cache length, prefill chunk) for a request; without a plan,
    the rows are a multiple of `data`, the devices that split the batch.
    """
    n = len(req.prompts)
    chunk = DEFAULT_PREFILL_CHUNK
    longest = max(len(p) for p in req.prompts)
    need = longest + req.max_new_tokens
    if given is not None:
        if n > given.max_batch:
            raise PlanError(f"{n} prompts exceed the plan's `max_batch={given.max_batch}`")
        seq, chunk = given.max_seq_len, given.prefill_chunk
        if need > seq:
            raise PlanError(
                f"prompt of {longest} tokens + `max_new_tokens={req.max_new_tokens}` exceeds "
                f"the plan's `max_seq_len={seq}`"
            )
        p = bucket(longest, MIN_PROMPT_BUCKET)
        if p > chunk:
            p = chunk * math.ceil(longest / chunk)
        if p + req.max_new_tokens > seq:
            p = longest if longest <= chunk else p
        if p + req.max_new_tokens > seq:
            raise PlanError(
                f"prompt of {longest} tokens is prefilled in chunks of {chunk} and then needs "
                f"{p} slots; with `max_new_tokens={req.max_new_tokens}` that exceeds the "
                f"plan's `max_seq_len={seq}`"
            )
        return given.max_batch, p, seq, min(p, chunk)
    p = bucket(longest, MIN_PROMPT_BUCKET)
    rows = data * math.ceil(bucket(n, 1) / data)
    return rows, p, p + bucket(req.max_new_tokens, MIN_NEW_TOKENS_BUCKET), min(p, chunk)


def _data_devices(model) -> int:
    partitioner = engine_of(model).partitioner
    return partitioner.data if partitioner is not None else 1


_PLAN_LOCK = threading.Lock()


# The steps `generate` runs (prefill and decode in one call), and those `stream` runs: the
# prefill and first token, then the decode loop chunk by chunk.
_STEPS = {False: ("generate",), True: ("start", "decode")}


def _plan_for(
    model, batch: int, p: int, seq: int, chunk: int, given: Plan | None, steps: tuple[str, ...]
) -> Plan:
    if given is not None:
        if given.engine is not engine_of(model):
            raise PlanError("`plan` was made for another model")
        return given
    engine = engine_of(model)
    # The plan compiles the steps of this request for exactly its prompt bucket, so the
    # executables it accounts for are the ones the request runs.
    key = (batch, p, seq, steps)
    with _PLAN_LOCK:
        if key not in engine.plans:
            engine.plans[key] = plan(
                model, max_batch=batch, max_seq_len=seq, prefill_chunk=chunk, steps=steps
            )
        return engine.plans[key]


def request_plan(
    model, batch: int, prompt_len: int, max_new_tokens: int, streaming: bool = False
) -> Plan:
    """The plan `generate` (or, with `streaming`, `stream`) makes and caches for `batch` prompts
    of at most `prompt_len` tokens and `max_new_tokens`.
    """
    req = _Request([[0] * prompt_len] * batch, False, max_new_tokens, {}, np.zeros(0), (), 0)
    rows, p, seq, chunk = _shapes(req, None, _data_devices(model))
    return _plan_for(model, rows, p, seq, chunk, None, _STEPS[streaming])


def _prepare(model, req: _Request, given: Plan | None, streaming: bool) -> tuple[Plan, int, dict]:
    """The plan of a request, its prefill chunk, and its padded inputs."""
    batch, p, seq, chunk = _shapes(req, given, _data_devices(model))
    the_plan = _plan_for(model, batch, p, seq, chunk, given, _STEPS[streaming])
    return the_plan, chunk, _inputs(req, batch, p)


def _inputs(req: _Request, batch: int, p: int) -> dict:
    n = len(req.prompts)
    prompt = np.zeros((batch, p), np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, ids in enumerate(req.prompts):
        prompt[i, p - len(ids) :] = ids
        lengths[i] = len(ids)
    # Padding rows copy row 0's settings; they stop at once and their output is dropped.
    params = {k: np.concatenate([v, np.repeat(v[:1], batch - n)]) for k, v in req.sampling.items()}
    rng = np.stack(
        [np.full((batch,), req.seed & 0xFFFFFFFF, np.uint32), np.arange(batch, dtype=np.uint32)],
        axis=1,
    )
    return dict(prompt=prompt, lengths=lengths, rng=rng, params=params, stop_ids=req.stop_ids)


def _find_stop(text: str, stop: tuple[str, ...]) -> int:
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else -1


def _cut(tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[str | None, list[int], bool]:
    """Text and ids before the first stop string; ids keep only tokens wholly before it."""
    if tokenizer is None:
        return None, ids, False
    text = tokenizer.decode(ids)
    at = _find_stop(text, stop) if stop else -1
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


def _fetch(x: jax.Array) -> np.ndarray:
    """`x` on the host, also when it spans the devices of several processes.

    Each process holds a replicated array whole. An array split across processes (the rows of
    the decode state on a `data` axis that spans them) is gathered from all of them, whole
    (`tiled=True`) rather than stacked by process: every process fetches the same arrays in the
    same order, as every process runs the same requests.
    """
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return multihost_utils.process_allgather(x, tiled=True)


def _read_rows(scratch, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = scratch["decode"]
    return (
        _fetch(d["tokens"])[:n],
        _fetch(d["num_generated"])[:n],
        _fetch(d["done"])[:n],
        int(_fetch(d["prompt_end"])),
    )


def generate(
    model,
    tokenizer,
    prompts,
    *,
    max_new_tokens: int,
    temperature=0.0,
    top_k=None,
    top_p=None,
    min_p=None,
    repetition_penalty=None,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    plan: Plan | None = None,
) -> GenerationResult:
    """Generate continuations of `prompts` in one XLA call.

    `prompts` is a string, a list of strings, a list of token ids, or a list of such lists.
    `temperature=0` is greedy; `top_k`, `top_p`, `min_p` and `repetition_penalty` filter the
    sampled distribution (Hugging Face conventions). Each sampling argument is a number or one
    number per prompt. Generation stops at `stop_token_ids` (default: the model's EOS tokens;
    `[]` for none), at `stop` strings (the text is cut before them) or after `max_new_tokens`.

    Example:
        >>> out = jaxlm.generate(model, tokenizer, ["The capital of France is"], max_new_tokens=8)
        >>> out.texts[0], out.finish_reasons[0]
        (' Paris.\\n\\nThe answer is: 2', 'length')
    """
    req = _request(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop_token_ids=stop_token_ids,
        stop=stop,
        plan=plan,
    )
    the_plan, chunk, x = _prepare(model, req, plan, streaming=False)
    engine = the_plan.engine
    scratch = the_plan.step("generate", x["prompt"].shape[1], chunk)(
        engine.params,
        the_plan.take(),
        x["prompt"],
        x["lengths"],
        x["rng"],
        x["params"],
        x["stop_ids"],
        np.int32(req.max_new_tokens),
    )
    tokens, counts, done, start = _read_rows(scratch, len(req.prompts))
    the_plan.keep(scratch)
    the_plan.ran()
    texts, token_ids, reasons = [], [], []
    for i in range(len(req.prompts)):
        ids = tokens[i, start : start + counts[i]].tolist()
        text, ids, stopped = _cut(tokenizer, ids, req.stop)
        texts.append(text)
        token_ids.append(ids)
        reasons.append("stop" if stopped or done[i] else "length")
    return GenerationResult(texts, token_ids, reasons, req.prompts)


class _Detokenizer:
    """Text of a growing list of ids, released only when it is final.

    Text ending in an incomplete UTF-8 sequence (U+FFFD) or in what could begin a stop string
    is held back until the next tokens settle it.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.sent = 0
        self.finished = False

    def update(self, ids: list[int], final: bool) -> str:
        if self.finished:
            return ""
        text = self.tokenizer.decode(ids)
        at = _find_stop(text, self.stop)
        if at >= 0:
            self.finished = True
            end = at
        elif final:
            self.finished = True
            end = len(text)
        else:
            end = len(text.rstrip("\ufffd"))
            for s in self.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end = min(end, len(text[:end]) - k)
                        break
        piece = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece


def stream(
    model,
    tokenizer,
    prompts,
    *,
    max_new_tokens: int,
    temperature=0.0,
    top_k=None,
    top_p=None,
    min_p=None,
    repetition_penalty=None,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    plan: Plan | None = None,
    chunk_tokens: int = STREAM_CHUNK,
) -> Iterator[str] | Iterator[list[str]]:
    """Yield text as it is generated; the same arguments and tokens as `generate`.

    For one prompt (a string or one list of ids) it yields strings; for a list of prompts, a
    list with one piece per prompt (empty when a row has nothing new). The loop runs in calls of
    `chunk_tokens` tokens, the scratch donated from one call to the next.

    Example:
        >>> for piece in jaxlm.stream(model, tokenizer, "Tell me a story", max_new_tokens=64):
        ...     print(piece, end="", flush=True)
    """
    if tokenizer is None:
        raise ValueError("`stream` yields text and needs a tokenizer")
    if not _is_int(chunk_tokens) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be an integer >= 1, got {chunk_tokens!r}")
    req = _request(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop_token_ids=stop_token_ids,
        stop=stop,
        plan=plan,
    )
    return _stream(model, tokenizer, req, plan, chunk_tokens)


def _stream(model, tokenizer, req: _Request, given: Plan | None, chunk_tokens: int):
    the_plan, chunk, x = _prepare(model, req, given, streaming=True)
    engine = the_plan.engine
    n = len(req.prompts)
    detok = [_Detokenizer(tokenizer, req.stop) for _ in range(n)]
    # The stream holds its scratch from the first call to the last; it goes back to the plan's
    # pool when the stream ends, and is dropped if the stream is abandoned or fails.
    scratch = the_plan.step("start", x["prompt"].shape[1], chunk)(
        engine.params,
        the_plan.take(),
        x["prompt"],
        x["lengths"],
        x["rng"],
        x["params"],
        x["stop_ids"],
    )
    generated = 1
    decode = the_plan.step("decode")
    while True:
        tokens, counts, done, start = _read_rows(scratch, n)
        the_plan.ran()
        final = generated >= req.max_new_tokens or bool(done.all())
        pieces = [
            d.update(tokens[i, start : start + counts[i]].tolist(), final or bool(done[i]))
            for i, d in enumerate(detok)
        ]
        if final or all(d.finished for d in detok):
            the_plan.keep(scratch)
            if any(pieces):
                yield pieces[0] if req.single else pieces
            return
        if any(pieces):
            yield pieces[0] if req.single else pieces
        generated = min(generated + chunk_tokens, req.max_new_tokens)
        scratch = decode(engine.params, scratch, x["params"], x["stop_ids"], np.int32(generated))


# `chat` takes a `stream` argument, which hides the function of that name inside it.
_stream_text = stream


def chat(
    model,
    tokenizer,
    messages: Sequence[dict],
    *,
    max_new_tokens: int = 256,
    stream: bool = False,
    **kwargs,
):
    """Reply to a conversation, rendered with the tokenizer's chat template.

    `messages` are dicts with `role` and `content`. Returns the reply text, or with
    `stream=True` an iterator of its pieces. Other arguments are those of `generate`.

    Example:
        >>> jaxlm.chat(model, tokenizer, [{"role": "user", "content": "Hi!"}])
    """
    if tokenizer is None:
        raise ValueError("`chat` needs a tokenizer with a chat template")
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    if stream:
        return _stream_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens, **kwargs)
    out = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, **kwargs)
    return out.texts[0]
