"""`generate`, `stream` and `chat`: the whole generation inside XLA.

`generate` makes one jitted call per request: prefill of the whole batch, then a
`lax.while_loop` that decodes, samples and checks stop tokens until every row is done. Python is
not involved per token, so the calling thread holds no GIL while the model runs. `stream` runs
the same loop in chunks of a few tokens per call, with the scratch donated from call to call.

The plans they make and keep, and the bucketed shapes that let requests share them, are in
`jaxlm.plans`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxlm import stops
from jaxlm.constrain import GrammarRows, grammar_of, grammars_for
from jaxlm.outputs import Delta, Progress, RequestOutput
from jaxlm.planner import Plan
from jaxlm.plans import (
    GENERATE,
    GENERATE_DRAFT,
    GENERATE_NGRAM,
    MASKED,
    STREAM,
    STREAM_DRAFT,
    STREAM_NGRAM,
    data_devices,
    plan_for,
    shapes,
)
from jaxlm.requests import Request, SamplingParams, is_int, parse_request, sampling_params
from jaxlm.speculative import check_draft, drafts_of
from jaxlm.stops import token_table

STREAM_CHUNK = 8


def _prepare(
    model, tokenizer, req: Request, given: Plan | None, steps: tuple[str, ...], drafts: int, draft
) -> tuple[Plan, int, dict]:
    """The plan of a request that runs `steps`, drafting `drafts` tokens a step (with the
    `draft` model, if not None), its prefill chunk, and its padded inputs."""
    batch, p, seq, chunk = shapes(req, given, data_devices(model), drafts)
    the_plan = plan_for(model, batch, p, seq, chunk, given, steps, drafts, draft)
    x = _inputs(req, batch, p, model.config.vocab_size)
    x["stops"] = _stops(tokenizer, req, model.config.vocab_size)
    return the_plan, chunk, x


@functools.cache
def _no_table(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((vocab_size, stops.TOKEN_BYTES), np.uint8), np.zeros((vocab_size,), np.int32)


def _stops(tokenizer, req: Request, vocab_size: int) -> dict:
    """The stop token ids, and the stop strings with the token table the loop checks them by,
    where it can (`jaxlm.stops`); otherwise only the host cuts the text at them."""
    table = token_table(tokenizer, vocab_size) if req.stop else None
    fits = len(req.stop) <= stops.MAX_STOPS and all(
        len(s.encode()) <= stops.STOP_BYTES for s in req.stop
    )
    strings = stops.encode_strings(req.stop if table is not None and fits else ())
    table, lengths = table if table is not None and fits else _no_table(vocab_size)
    return dict(ids=req.stop_ids, strings=strings, table=table, lengths=lengths)


def _inputs(req: Request, batch: int, p: int, vocab_size: int) -> dict:
    n = len(req.prompts)
    prompt = np.zeros((batch, p), np.int32)
    lengths = np.zeros((batch,), np.int32)
    for i, ids in enumerate(req.prompts):
        prompt[i, : len(ids)] = ids
        lengths[i] = len(ids)
    # Padding rows (no prompt) copy row 0's settings; they are done from the start.
    sampling = {
        k: np.concatenate([v, np.repeat(v[:1], batch - n)]) for k, v in req.sampling.items()
    }
    rows = lambda value: np.full((batch,), value, np.float32)
    bias_ids, bias = (np.tile(a, (batch, 1)) for a in req.bias_row(vocab_size))
    params = dict(
        params=sampling,
        penalties=dict(
            presence=rows(req.params.presence_penalty),
            frequency=rows(req.params.frequency_penalty),
        ),
        bias_ids=bias_ids,
        bias=bias,
    )
    rng = np.stack(
        [
            np.full((batch,), req.params.seed & 0xFFFFFFFF, np.uint32),
            np.arange(batch, dtype=np.uint32),
        ],
        axis=1,
    )
    return dict(prompt=prompt, lengths=lengths, rng=rng, params=params)


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


def _read_rows(scratch, req: Request) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's generated tokens, how many of them come before its stop token and within
    `max_new_tokens`, and whether it stopped there (a chunk of drafts may sample past either,
    or past a stop string within them: the text's cut finds it)."""
    d, n = scratch["decode"], len(req.prompts)
    tokens, sampled = _fetch(d["tokens"])[:n], _fetch(d["sampled"])[:n]
    # Each row's generated tokens from its prompt's end on; past the last, what the slots held.
    start = _fetch(d["prompt_len"])[:n, None]
    at = np.minimum(start + np.arange(tokens.shape[1] - start.min()), tokens.shape[1] - 1)
    tokens = np.take_along_axis(tokens, at, axis=1)
    counts = np.minimum(sampled, req.max_new_tokens)
    done = _fetch(d["done"])[:n] & (sampled <= req.max_new_tokens)
    for i in range(n):
        stop = np.flatnonzero(np.isin(tokens[i, : counts[i]], req.stop_ids))
        if stop.size:
            counts[i], done[i] = stop[0], True
    return tokens, counts, done


def _drafts(scratch, n: int) -> list[tuple[int, int]]:
    """Each row's tokens drafted and those of them kept."""
    d = scratch["decode"]
    drafted, accepted = _fetch(d["drafted"])[:n].tolist(), _fetch(d["accepted"])[:n].tolist()
    return list(zip(drafted, accepted, strict=True))


def _drafts_asked(model, speculative, num_speculative_tokens, response_format, given):
    """The tokens a step drafts (0: none), and the draft model that drafts them (None: none, or
    prompt lookup); a `plan` given sets the tokens unless they are asked."""
    drafts = drafts_of(speculative, num_speculative_tokens, draft_models=True)
    draft = speculative if isinstance(speculative, nnx.Module) else None
    if draft is not None:
        check_draft(model, draft)
    if drafts and response_format is not None:
        raise ValueError("`speculative` and `response_format` do not combine: give one")
    if drafts and num_speculative_tokens is None and given is not None:
        return given.num_speculative_tokens, draft
    return drafts, draft


def _request(model, tokenizer, prompts, params, fields, plan) -> Request:
    """The checked request of `generate`'s or `stream`'s arguments."""
    params = sampling_params(params, fields)
    if params.logprobs is not None:
        raise ValueError("`logprobs` come from `LLMEngine`, not from `generate` or `stream`")
    return parse_request(model, tokenizer, prompts, params, plan)


def generate(
    model,
    tokenizer,
    prompts,
    params: SamplingParams | None = None,
    *,
    plan: Plan | None = None,
    speculative: str | nnx.Module | None = None,
    num_speculative_tokens: int | None = None,
    **sampling,
) -> list[RequestOutput]:
    """Generate continuations of `prompts` in one XLA call; one `RequestOutput` per prompt.

    `prompts` is a string, a list of strings, a list of token ids, or a list of such lists.
    `params` is a `jaxlm.SamplingParams`; its fields given as keywords (`max_new_tokens=`,
    `temperature=`, `stop=`, ...) make one, or replace those of `params`. Each sampling field is
    a number or one number per prompt, but for OpenAI's penalties and `logit_bias`, which hold
    for every prompt; `logprobs` are `LLMEngine`'s.

    Under a `response_format` each token's mask comes from the host, so a constrained request
    runs one call per token rather than one in all.

    `speculative="ngram"` drafts tokens from each prompt's own text (`jaxlm.speculative`),
    `num_speculative_tokens` (3, at most 16) a step, and checks them in the same call: the same
    tokens, fewer steps where the output repeats the input; each output's `drafted_tokens` and
    `accepted_tokens` count them. `speculative=draft`, a smaller model of the same vocabulary
    (`jaxlm.load`ed like `model`), drafts with that model's greedy tokens instead, in the same
    call: the same tokens again, fewer steps where the draft model guesses the model's.

    Example:
        >>> out = jaxlm.generate(model, tokenizer, "The capital of France is", max_new_tokens=8)
        >>> out[0].text, out[0].finish_reason
        (' Paris.\\n\\nThe answer is: 2', 'length')
    """
    req = _request(model, tokenizer, prompts, params, sampling, plan)
    response_format = req.params.response_format
    drafts, draft = _drafts_asked(model, speculative, num_speculative_tokens, response_format, plan)
    constrained = _constrained(model, tokenizer, response_format, len(req.prompts))
    if constrained is not None:
        *_, (tokens, counts, done, _) = _calls(
            model, tokenizer, req, plan, None, constrained, MASKED, 0
        )
        return _result(tokenizer, req, tokens, counts, done)
    steps = GENERATE_DRAFT if draft is not None else GENERATE_NGRAM if drafts else GENERATE
    the_plan, chunk, x = _prepare(model, tokenizer, req, plan, steps, drafts, draft)
    generator = the_plan.generator
    scratch = the_plan.step(steps[0], x["prompt"].shape[1], chunk)(
        generator.params,
        the_plan.take(),
        x["prompt"],
        x["lengths"],
        x["rng"],
        x["params"],
        x["stops"],
        np.int32(req.max_new_tokens),
    )
    tokens, counts, done = _read_rows(scratch, req)
    drafts = _drafts(scratch, len(req.prompts))
    the_plan.keep(scratch)
    the_plan.ran()
    return _result(tokenizer, req, tokens, counts, done, drafts)


def _result(tokenizer, req: Request, tokens, counts, done, drafts=None) -> list[RequestOutput]:
    # `tokens[i, :counts[i]]` are row `i`'s, stop tokens left out.
    out = []
    for i, prompt in enumerate(req.prompts):
        progress = Progress(tokenizer, req.stop, prompt)
        progress.update(tokens[i, : counts[i]].tolist(), True, "stop" if done[i] else "length")
        out.append(progress.result)
        if drafts is not None:
            out[-1].drafted_tokens, out[-1].accepted_tokens = drafts[i]
    return out


def stream(
    model,
    tokenizer,
    prompts,
    params: SamplingParams | None = None,
    *,
    plan: Plan | None = None,
    chunk_tokens: int = STREAM_CHUNK,
    speculative: str | nnx.Module | None = None,
    num_speculative_tokens: int | None = None,
    **sampling,
) -> Iterator[Delta] | Iterator[list[Delta]]:
    """Yield the output as it is generated: `generate`'s arguments, and its tokens.

    For one prompt (a string or one list of ids) it yields `Delta`s (new text and token ids);
    for a list of prompts, a list with one per prompt (empty when a row has nothing new). A
    prompt's last delta carries its `finish_reason`. The loop runs in calls of `chunk_tokens`
    tokens (one under a `response_format`), the scratch donated from one call to the next.

    Example:
        >>> for delta in jaxlm.stream(model, tokenizer, "Tell me a story", max_new_tokens=64):
        ...     print(delta.text, end="", flush=True)
    """
    if tokenizer is None:
        raise ValueError("`stream` yields text and needs a tokenizer")
    if not is_int(chunk_tokens) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be an integer >= 1, got {chunk_tokens!r}")
    req = _request(model, tokenizer, prompts, params, sampling, plan)
    response_format = req.params.response_format
    drafts, draft = _drafts_asked(model, speculative, num_speculative_tokens, response_format, plan)
    constrained = _constrained(model, tokenizer, response_format, len(req.prompts))
    steps = STREAM_DRAFT if draft is not None else STREAM_NGRAM if drafts else STREAM
    steps = MASKED if constrained is not None else steps
    return _stream(model, tokenizer, req, plan, chunk_tokens, constrained, steps, drafts, draft)


def _stream(model, tokenizer, req: Request, given, chunk_tokens, constrained, steps, drafts, draft):
    rows = [Progress(tokenizer, req.stop, prompt) for prompt in req.prompts]

    def cut() -> bool:
        # Every row's text is final once each has met a stop string.
        return all(r.result is not None for r in rows)

    for tokens, counts, done, final in _calls(
        model, tokenizer, req, given, chunk_tokens, constrained, steps, drafts, draft, cut
    ):
        deltas = []
        for i, row in enumerate(rows):
            ended = final or bool(done[i])
            reason = "stop" if done[i] else "length"
            delta = None
            if row.result is None:
                delta = row.update(tokens[i, : counts[i]].tolist(), ended, reason)
            deltas.append(delta or Delta("", []))
        if any(d.text or d.token_ids or d.finish_reason for d in deltas):
            yield deltas[0] if req.single else deltas


def _constrained(model, tokenizer, response_format, n: int) -> GrammarRows | None:
    """The grammar rows of `n` prompts under `response_format`, or None without one."""
    grammar = grammar_of(response_format)
    if grammar is None:
        return None
    return GrammarRows(grammars_for(tokenizer, model.config.vocab_size), grammar, n)


def _calls(
    model,
    tokenizer,
    req: Request,
    given,
    chunk_tokens,
    constrained,
    steps,
    drafts: int,
    draft=None,
    cut=lambda: False,
):
    """Run `stream`'s calls (`steps`, drafting `drafts` tokens a step, with the `draft` model if
    not None): the prefill and first token, then the decode loop `chunk_tokens` tokens at a
    time, or one at a time under the rows' grammars (`constrained`), until every row is done or
    `cut()`. After each call yields
    each row's tokens `[rows, n]`, their counts (stop tokens left out), whether each row is done
    (a stop token, or its grammar complete) and whether the call was the last.
    """
    the_plan, chunk, x = _prepare(model, tokenizer, req, given, steps, drafts, draft)
    n, rows = len(req.prompts), x["prompt"].shape[0]
    # The stream holds its scratch from the first call to the last; it goes back to the plan's
    # pool when the stream ends, and is dropped if the stream is abandoned or fails.
    masked = {} if constrained is None else {"mask": constrained.masks(rows, np.zeros(n, bool))}
    first = the_plan.step(steps[0], x["prompt"].shape[1], chunk)
    prompt = (x["prompt"], x["lengths"], x["rng"], x["params"], x["stops"])
    scratch = first(the_plan.generator.params, the_plan.take(), *prompt, **masked)
    generated = 1
    while True:
        tokens, counts, done = _read_rows(scratch, req)
        the_plan.ran()
        if constrained is not None:
            counts, done = constrained.advance(tokens, counts, done)
        if generated >= req.max_new_tokens or bool(done.all()):
            the_plan.keep(scratch)
            yield tokens, counts, done, True
            return
        yield tokens, counts, done, False
        if cut():
            the_plan.keep(scratch)
            return
        if constrained is None:
            generated = min(generated + chunk_tokens, req.max_new_tokens)
        else:
            # A grammar's mask holds for one token.
            generated += 1
            masked = {"mask": constrained.masks(rows, done)}
        step = the_plan.step(steps[1])
        limit = np.int32(generated)
        scratch = step(the_plan.generator.params, scratch, x["params"], x["stops"], limit, **masked)


# `chat` takes a `stream` argument, which hides the function of that name inside it.
_stream_deltas = stream


def chat(
    model,
    tokenizer,
    messages: Sequence[dict],
    params: SamplingParams | None = None,
    *,
    stream: bool = False,
    **kwargs,
):
    """Reply to a conversation, rendered with the tokenizer's chat template.

    `messages` are dicts with `role` and `content`. Returns the reply text, or with
    `stream=True` an iterator of its pieces of text. Other arguments are those of `generate`;
    `max_new_tokens` is 256 unless given.

    Example:
        >>> jaxlm.chat(model, tokenizer, [{"role": "user", "content": "Hi!"}])
    """
    if tokenizer is None:
        raise ValueError("`chat` needs a tokenizer with a chat template")
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    if params is None:
        kwargs.setdefault("max_new_tokens", 256)
    if stream:
        deltas = _stream_deltas(model, tokenizer, prompt, params, **kwargs)
        return (d.text for d in deltas if d.text)
    return generate(model, tokenizer, prompt, params, **kwargs)[0].text
