"""The plans `generate`, `stream` and `chat` make and keep for the requests they run.

Shapes are bucketed so that new requests rarely compile:
- the batch is padded to a power of two (1, 2, 4, 8, ...) rows;
- prompts are padded to a power of two of at least 16 tokens (16, 32, 64, ...), and
  prompts longer than the plan's prefill chunk to a multiple of it;
- `max_new_tokens` is rounded up to a power of two of at least 16 for the size of the cache;
  the loop itself stops at the exact number asked for, which is a traced value;
- sampling parameters are traced per-row values: changing them never compiles.
Without a `plan`, one is made for the bucketed shape (batch, prompt + new tokens) and kept for
later requests of the same shape: the `KEPT_PLANS` most recent are kept, and only the one in
use holds scratch between calls (`jaxlm.plans_of`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import numpy as np

from jaxlm.errors import PlanError
from jaxlm.generator import DEFAULT_PREFILL_CHUNK, generator_of
from jaxlm.planner import Plan, plan
from jaxlm.requests import Request, SamplingParams

MIN_PROMPT_BUCKET = 16
MIN_NEW_TOKENS_BUCKET = 16
# The plans kept per model for the shapes requests ran; an older one compiles again if needed.
KEPT_PLANS = 4


def bucket(n: int, minimum: int) -> int:
    """The power of two >= `n`, at least `minimum`."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def shapes(
    req: Request, given: Plan | None, data: int = 1, spare: int = 0
) -> tuple[int, int, int, int]:
    """(batch rows, prompt length, cache length, prefill chunk) for a request; without a plan,
    the rows are a multiple of `data`, the devices that split the batch, and the cache has
    `spare` slots more (for drafts past the last token), added after the bucket: every step's
    attention reads every slot, and a bucket of the new tokens and the drafts together doubled
    them for a power of two of new tokens (`docs/performance.md`, "Speculative decoding").
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
    return rows, p, p + bucket(req.max_new_tokens, MIN_NEW_TOKENS_BUCKET) + spare, min(p, chunk)


def data_devices(model) -> int:
    partitioner = generator_of(model).partitioner
    return partitioner.data if partitioner is not None else 1


_PLAN_LOCK = threading.Lock()


# The steps `generate` runs (prefill and decode in one call), and those `stream` runs: the
# prefill and first token, then the decode loop chunk by chunk; under a grammar, the same with
# each row's token mask, a token a call.
GENERATE, STREAM, MASKED = ("generate",), ("start", "decode"), ("start_masked", "decode_masked")
# The same with prompt-lookup drafts (`speculative="ngram"`).
GENERATE_NGRAM, STREAM_NGRAM = ("generate_ngram",), ("start", "decode_ngram")
# The same with a draft model's drafts (`speculative=` a model).
GENERATE_DRAFT, STREAM_DRAFT = ("generate_draft",), ("start_draft", "decode_draft")


def plan_for(
    model,
    batch: int,
    p: int,
    seq: int,
    chunk: int,
    given: Plan | None,
    steps: tuple[str, ...],
    drafts: int,
    draft=None,
) -> Plan:
    """The plan of a request's shapes: `given`, else the one kept for them, made if none is;
    `drafts` are the tokens a step of the `_ngram` and `_draft` steps drafts, the latter with
    the `draft` model."""
    generator = generator_of(model, draft)
    if given is not None:
        if given.generator is not generator:
            raise PlanError("`plan` was made for another model, or another draft model")
        if drafts and given.num_speculative_tokens != drafts:
            raise PlanError(
                f"`num_speculative_tokens={drafts}` differs from the plan's "
                f"{given.num_speculative_tokens}"
            )
        return given
    # The plan compiles the steps of this request for exactly its prompt bucket, so the
    # executables it accounts for are the ones the request runs.
    key = (batch, p, seq, steps, drafts)
    with _PLAN_LOCK:
        plans = generator.plans
        the_plan = plans.pop(key, None)
        if the_plan is None:
            the_plan = plan(
                model,
                max_batch=batch,
                max_seq_len=seq,
                prefill_chunk=chunk,
                steps=steps,
                speculative=draft,
                num_speculative_tokens=drafts or None,
            )
        plans[key] = the_plan  # the most recent last
        # Only the plan in use keeps scratch between requests, and the `KEPT_PLANS` most
        # recent keep their executables: a model's memory stays within its largest plan's bill.
        for other in list(plans.values())[:-1]:
            other.release()
        the_plan.pooling = True
        while len(plans) > KEPT_PLANS:
            plans.pop(next(iter(plans)))
        return the_plan


class GenerationPlans:
    """The plans `generate`, `stream` and `chat` keep for a model (`jaxlm.plans_of`): those it
    drafts for with each draft model after its own, the most recent first, each compiled for
    one bucketed shape (rows, prompt, cache length). Only the most recent of each holds scratch
    between calls, and at most `KEPT_PLANS` of each are kept; `clear()` frees them all.

    Example:
        >>> jaxlm.generate(model, tokenizer, "Hello", max_new_tokens=8)
        >>> plans = jaxlm.plans_of(model)
        >>> plans                        # each plan's shapes and bill, and which holds scratch
        >>> plans.clear()                # the next call plans again
    """

    def __init__(self, generator):
        self._generator = generator

    def _generators(self) -> list:
        return [self._generator, *self._generator.drafted.values()]

    def _plans(self) -> list[Plan]:
        with _PLAN_LOCK:
            return [p for g in self._generators() for p in list(g.plans.values())[::-1]]

    def __iter__(self) -> Iterator[Plan]:
        return iter(self._plans())

    def __len__(self) -> int:
        return len(self._plans())

    def __getitem__(self, i: int) -> Plan:
        return self._plans()[i]

    def clear(self) -> None:
        """Drop every plan, its executables and its scratch (requests running keep theirs)."""
        with _PLAN_LOCK:
            for generator in self._generators():
                for p in generator.plans.values():
                    p.release()
                generator.plans.clear()

    def __repr__(self) -> str:
        rows = [f"  {p!r}" + (", holds its scratch" if p.pooled else "") for p in self._plans()]
        kept = f"at most {KEPT_PLANS} without a draft model and {KEPT_PLANS} with each"
        return "\n".join([f"{len(rows)} plans ({kept}), the most recent first:", *rows])


def plans_of(model) -> GenerationPlans:
    """The plans `generate`, `stream` and `chat` keep for `model`; see `GenerationPlans`."""
    return GenerationPlans(generator_of(model))


def request_plan(
    model, batch: int, prompt_len: int, max_new_tokens: int, streaming: bool = False
) -> Plan:
    """The plan `generate` (or, with `streaming`, `stream`) makes and caches for `batch` prompts
    of at most `prompt_len` tokens and `max_new_tokens`.
    """
    prompts, params = [[0] * prompt_len] * batch, SamplingParams(max_new_tokens)
    req = Request(prompts, False, params, {}, np.zeros(0), (), ())
    rows, p, seq, chunk = shapes(req, None, data_devices(model))
    return plan_for(model, rows, p, seq, chunk, None, STREAM if streaming else GENERATE, 0)
