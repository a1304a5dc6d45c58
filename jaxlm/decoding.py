"""The generation loop's math: prefill, sampling, stop checks and the decode loops, plain and
with drafts, over a plan's scratch (`jaxlm.generator` jits them as steps).

The generation loop keeps its state in the `"decode"` part of the scratch:
- `tokens[b, s]` is the token at slot `s` of row `b`. Prompts are left-padded to a shared length
  `P`, so every row feeds the same slot each step; row `b`'s prompt starts at slot `start[b]`,
  and slot `s` is its position `s - start[b]`. Generated tokens go to slots `P, P + 1, ...`.
- The token at slot `index` has been sampled but not yet fed to the model.
- `num_generated[b]` counts the tokens of row `b` before its first stop token; `done[b]` is set
  once a stop token is sampled or a stop string is complete.
- `rng[b]` is row `b`'s key; the key of its `n`-th token is `fold_in(rng[b], n)`, so a row's
  samples depend neither on the other rows nor on how a stream is cut into chunks.
- `tail[b]` holds the last bytes of row `b`'s generated text, so that the loop ends a row at a
  stop string (`jaxlm.stops`).

A step's `stops` are the stop token ids, padded with -1, and the stop strings with the table of
each token's bytes that the loop reads them with (`jaxlm.stops`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import speculative, stops
from jaxlm.batching import sampled
from jaxlm.memory import ScratchSpec
from jaxlm.ops import write_cache

# The most slots of a page in `generate`'s plans: a row's pages are its own, so large pages only
# make the gather of a row's keys and values cheaper, down to the 256 slots attention reads at
# least (`jaxlm.ops.attend_paged`).
PAGE_SLOTS = 256


class DecodeState(nnx.Module):
    """The generation loop's own scratch, declared like the model's pages."""

    def __init__(self):
        self.tokens = ScratchSpec(
            ("batch", "seq"), jnp.int32, axes=("batch", None), doc="token at each slot"
        )
        self.start = ScratchSpec(("batch",), jnp.int32, axes=("batch",), doc="row's first slot")
        self.index = ScratchSpec((), jnp.int32, doc="slot of the next token to run")
        self.rng = ScratchSpec(("batch", 2), jnp.uint32, axes=("batch", None), doc="PRNG key")
        self.done = ScratchSpec(("batch",), jnp.bool_, axes=("batch",), doc="stop token seen")
        self.num_generated = ScratchSpec(
            ("batch",), jnp.int32, axes=("batch",), doc="tokens before the stop"
        )
        self.prompt_end = ScratchSpec((), jnp.int32, doc="slot of the first generated token")
        self.tail = ScratchSpec(
            ("batch", stops.TAIL), jnp.int32, axes=("batch", None), doc="last bytes of the text"
        )
        self.drafted = ScratchSpec(("batch",), jnp.int32, axes=("batch",), doc="tokens drafted")
        self.accepted = ScratchSpec(
            ("batch",), jnp.int32, axes=("batch",), doc="drafted tokens kept"
        )


def _forward(model, scratch, ids, last):
    """Run `ids` `[B, T]`, the tokens of slots `index ..` of every row, over the rows' pages;
    returns the logits of column `last` (of every column where `last` is None) and the scratch
    with the pages written and `index` advanced. Row `b` owns pages `b * per_row ..` in order
    (`page_count`), and its slot `s` is position `s - start[b]` (negative: padding, not
    written)."""
    d = scratch["decode"]
    b, t = ids.shape
    num_pages = scratch["model"]["layers"][0]["self_attn"]["k_pages"].shape[0]
    table = jnp.arange(num_pages, dtype=jnp.int32).reshape(b, num_pages // b)
    positions = d["index"] + jnp.arange(t, dtype=jnp.int32)[None, :] - d["start"][:, None]
    group = dict(
        input_ids=ids,
        positions=jnp.where(positions >= 0, positions, -1),
        table=table,
        last=None if last is None else jnp.full((b,), last, jnp.int32),
    )
    (logits,), cache = model.forward_paged([group], {"model": scratch["model"]})
    decode = {**d, "index": d["index"] + t}
    return logits, {**scratch, **cache, "decode": decode}


def page_count(batch: int, seq: int) -> tuple[int, int]:
    """`(num_pages, page_size)` of a plan of `batch` rows of `seq` slots: each row's slots in
    pages of at most `PAGE_SLOTS`, as evenly as they split, and at least two pages in all: XLA
    drops a unit dimension of one page with a bitcast between the pages' update and their
    read, and then copies the pages every step."""
    per_row = max(-(-seq // PAGE_SLOTS), 2 if batch == 1 else 1)
    return batch * per_row, -(-seq // per_row)


def _reset_and_prefill(model, scratch, prompt, lengths, chunk):
    """Reset the rows to the left-padded `prompt` [B, P] and run it in chunks of `chunk`."""
    b, p = prompt.shape
    d = {**scratch["decode"], "index": jnp.int32(0), "start": (p - lengths).astype(jnp.int32)}
    state = {**scratch, "decode": d}
    n_chunks = p // chunk

    def run(i, carry):
        state, _ = carry
        ids = jax.lax.dynamic_slice(prompt, (0, i * chunk), (b, chunk))
        logits, state = _forward(model, state, ids, chunk - 1)
        return state, logits

    logits0 = jnp.zeros((b, model.config.vocab_size), jnp.float32)
    if n_chunks == 1:
        return run(0, (state, logits0))
    return jax.lax.fori_loop(0, n_chunks, run, (state, logits0))


def _choose(d, logits, params, slots, mask=None):
    """Each row's token at each of `slots` `[T]` from `logits` `[B, T, V]`, the logits before
    those slots, sampled as the engine's step samples (`jaxlm.batching.sampled`, `params` its
    sampling inputs): the `repetition_penalty` over a row's tokens before each slot, prompt
    included, OpenAI's penalties over those it generated, and with a `mask` (`[B, ceil(vocab /
    32)]` bits) only among the tokens it allows. The key of a row's token at slot `s` is
    `fold_in(rng, s - prompt_end)`, however many tokens a step samples."""
    b, t, v = logits.shape
    every = jnp.arange(d["tokens"].shape[1])

    def counts(first):
        # Each row's tokens from slot `first` [B] up to each of `slots`, counted: [B * T, V].
        valid = (every >= first[:, None, None]) & (every < slots[None, :, None])
        ids = jnp.where(valid, d["tokens"][:, None, :], v).reshape(b * t, -1)
        rows = jnp.arange(b * t)[:, None]
        return jnp.zeros((b * t, v), jnp.int32).at[rows, ids].add(1, mode="drop")

    x = dict(
        params,
        keys=d["rng"],
        masked=jnp.bool_(mask is not None),
        mask=jnp.zeros((b, -(-v // 32)), jnp.int32) if mask is None else mask,
        logprobs=jnp.bool_(False),
    )
    generated = jnp.broadcast_to(slots - d["prompt_end"], (b, t))
    token, *_ = sampled.sample_positions(
        logits,
        x,
        generated,
        lambda: counts(d["start"]) > 0,
        lambda: counts(jnp.broadcast_to(d["prompt_end"], (b,))),
    )
    return token


def _record(d, token, slot, stop):
    """The decode state with each row's `token` `[B]` at `slot`: counted unless a stop token,
    and the row done at a stop token or a complete stop string."""
    is_stop = jnp.any(token[:, None] == stop["ids"][None, :], axis=1)
    # The token that completes a stop string counts as generated: the host cuts the text.
    tail, at_string = jax.lax.cond(
        jnp.any(stop["strings"] >= 0),
        lambda tail: stops.advance(tail, token, stop["strings"], stop["table"], stop["lengths"]),
        lambda tail: (tail, jnp.zeros(token.shape, bool)),
        d["tail"],
    )
    done = d["done"]
    return {
        **d,
        "tokens": write_cache(d["tokens"], token[:, None], slot, axis=1),
        "num_generated": d["num_generated"] + (~done & ~is_stop),
        "done": done | is_stop | at_string,
        "tail": tail,
    }


def _sample_next(scratch, logits, params, stop, mask):
    """Sample the token of slot `index` and record it in the decode state."""
    d = scratch["decode"]
    token = _choose(d, logits[:, None], params, d["index"][None], mask)[:, 0]
    return {**scratch, "decode": _record(d, token, d["index"], stop)}


def start(model, scratch, prompt, lengths, rng, params, stop, chunk, mask=None):
    """Prefill the prompts and sample each row's first token (among those `mask` allows)."""
    scratch, logits = _reset_and_prefill(model, scratch, prompt, lengths, chunk)
    b, p = prompt.shape
    d = scratch["decode"]
    tokens = jax.lax.dynamic_update_slice(d["tokens"], prompt, (0, 0))
    d = {
        **d,
        "tokens": tokens,
        "rng": rng,
        "done": jnp.zeros((b,), bool),
        "num_generated": jnp.zeros((b,), jnp.int32),
        "prompt_end": jnp.int32(p),
        "tail": jnp.full(d["tail"].shape, -1, jnp.int32),
        "drafted": jnp.zeros((b,), jnp.int32),
        "accepted": jnp.zeros((b,), jnp.int32),
    }
    return _sample_next({**scratch, "decode": d}, logits, params, stop, mask)


def _generated(s):
    return s["decode"]["index"] - s["decode"]["prompt_end"] + 1


def _running(s, limit):
    return (_generated(s) < limit) & ~jnp.all(s["decode"]["done"])


def _one_token(model, s, params, stop, mask):
    token = jax.lax.dynamic_slice_in_dim(s["decode"]["tokens"], s["decode"]["index"], 1, 1)
    logits, s = _forward(model, s, token, 0)
    return _sample_next(s, logits, params, stop, mask)


def decode_loop(model, scratch, params, stop, limit, mask=None):
    """Decode until every row is done or `limit` tokens have been sampled in all; with a `mask`,
    each token among those it allows (a grammar's mask holds for one token: the host gives the
    next `limit` one more than the tokens sampled)."""
    return jax.lax.while_loop(
        lambda s: _running(s, limit),
        lambda s: _one_token(model, s, params, stop, mask),
        scratch,
    )


def _room(s, limit, drafts):
    """Whether a chunk of `drafts` drafts fits the rows' slots and the tokens left to sample."""
    d = s["decode"]
    return (d["index"] + drafts < d["tokens"].shape[1]) & (limit - _generated(s) > 1)


def _verify(model, s, proposed, params, stop, limit):
    """Run each row's last token and its drafts `proposed` `[B, drafts]` as one chunk; keep the
    drafts every row accepts and the token sampled after them."""
    d = s["decode"]
    drafts = proposed.shape[1]
    index, done, left = d["index"], d["done"], limit - _generated(s) - 1
    # The drafts take their slots first, so that each position's penalty sees those before.
    tokens = jax.lax.dynamic_update_slice(d["tokens"], proposed, (0, index + 1))
    ids = jax.lax.dynamic_slice_in_dim(tokens, index, drafts + 1, 1)
    logits, s = _forward(model, {**s, "decode": {**d, "tokens": tokens}}, ids, None)
    slots = index + 1 + jnp.arange(drafts + 1, dtype=jnp.int32)
    sampled = _choose(s["decode"], logits, params, slots)
    keep = jnp.minimum(speculative.accepted(sampled, proposed, done), left)
    d = jax.lax.fori_loop(
        0,
        keep + 1,
        lambda j, d: _record(d, sampled[:, j], slots[j], stop),
        s["decode"],
    )
    d = {
        **d,
        "index": index + 1 + keep,
        "drafted": d["drafted"] + jnp.where(done, 0, drafts),
        "accepted": d["accepted"] + jnp.where(done, 0, keep),
    }
    return {**s, "decode": d}


def _drafting_loop(model, scratch, params, stop, limit, look_up, propose, before_single):
    """`decode_loop` with drafts: a step where `look_up(s) -> (drafts, go)` (computed once a
    step, after it) says go runs each row's last token and its drafts (`propose(s, drafts) ->
    (s, drafts)`, just before) as one chunk and keeps what they accept, otherwise one token
    (`before_single(s) -> s` first); the tokens are those `decode_loop` gives."""

    # The carry: the state, the tokens to wait before drafting, the wait after the next miss,
    # and the state's drafts and whether the next step verifies them.
    def single(c):
        s, wait, backoff, _, _ = c
        s = _one_token(model, before_single(s), params, stop, None)
        return (s, jnp.maximum(wait - 1, 0), backoff, *look_up(s))

    def chunk(c):
        s, _, backoff, proposed, _ = c
        before = s["decode"]["accepted"]
        s = _verify(model, *propose(s, proposed), params, stop, limit)
        # A chunk that kept no draft cost more than the token it gave: wait twice as long
        # before the next (at most `MAX_BACKOFF` tokens); one that kept a draft resets.
        missed = jnp.all(s["decode"]["accepted"] == before)
        backoff = jnp.where(missed, jnp.minimum(2 * backoff, speculative.MAX_BACKOFF), 1)
        return (s, jnp.where(missed, backoff, 0), backoff, *look_up(s))

    def body(c):
        # Single tokens until every row drafts, then one chunk: loops rather than a `lax.cond`,
        # whose branches XLA:CPU gives copies of the pages (see `docs/performance.md`,
        # "Speculative decoding").
        c = jax.lax.while_loop(lambda c: _running(c[0], limit) & ((c[1] > 0) | ~c[4]), single, c)
        c, _ = jax.lax.while_loop(
            lambda c: c[1] & c[0][4], lambda c: (chunk(c[0]), False), (c, True)
        )
        return c

    one = jnp.int32(1)
    c = (scratch, one - 1, one, *look_up(scratch))
    return jax.lax.while_loop(lambda c: _running(c[0], limit), body, c)[0]


def decode_loop_ngram(model, scratch, params, stop, limit, drafts):
    """`decode_loop` with prompt-lookup drafts (`jaxlm.speculative`): a step where every
    unfinished row finds `drafts` drafts verifies them; the tokens are those `decode_loop`
    gives."""

    def look_up(s):
        d = s["decode"]
        proposed, found = speculative.propose(d["tokens"], d["start"], d["index"], drafts)
        go = jnp.all(found | d["done"]) & _room(s, limit, drafts) & _running(s, limit)
        return proposed, go

    return _drafting_loop(
        model, scratch, params, stop, limit, look_up, lambda s, p: (s, p), lambda s: s
    )


# A draft model keeps pages of its own (`scratch["draft"]`), a slot behind the target's at most:
# before each step they hold every slot before `index - 1` (`index`: the slot of the last token,
# sampled but not run). A chunk of drafts runs the draft on slots `index - 1` and `index`, then
# on each draft but the last; whatever the target keeps of them, the draft's pages then hold
# every slot before the new `index - 1`. Before a single token of the target, the draft runs
# slot `index - 1`.


def _draft_forward(draft, s, ids, first, last):
    """Run the draft model on `ids` `[B, T]` at slots `first ..` of every row, over its own
    pages; returns its logits of column `last` and the state with those pages written."""
    view = {**s["draft"], "decode": {**s["decode"], "index": first}}
    logits, out = _forward(draft, view, ids, last)
    return logits, {**s, "draft": {name: out[name] for name in s["draft"]}}


def _draft_prefill(draft, s, prompt, chunk):
    """The draft model's pages of the left-padded `prompt`, in chunks of `chunk` as the
    target's."""
    b, p = prompt.shape

    def run(i, s):
        ids = jax.lax.dynamic_slice(prompt, (0, i * chunk), (b, chunk))
        return _draft_forward(draft, s, ids, i * chunk, chunk - 1)[1]

    return run(0, s) if p == chunk else jax.lax.fori_loop(0, p // chunk, run, s)


def _draft_tokens(draft, s, drafts):
    """Each row's `drafts` next tokens, the draft model's greedy choices after its last token;
    the target's verification keeps its own tokens whatever they are."""
    d = s["decode"]
    index = d["index"]
    ids = jax.lax.dynamic_slice_in_dim(d["tokens"], index - 1, 2, 1)
    logits, s = _draft_forward(draft, s, ids, index - 1, 1)

    def next_token(j, c):
        s, proposed, logits = c
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        proposed = jax.lax.dynamic_update_slice(proposed, token[:, None], (0, j))
        logits, s = _draft_forward(draft, s, token[:, None], index + 1 + j, 0)
        return s, proposed, logits

    proposed = jnp.zeros((ids.shape[0], drafts), jnp.int32)
    s, proposed, logits = jax.lax.fori_loop(0, drafts - 1, next_token, (s, proposed, logits))
    last = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return s, proposed.at[:, drafts - 1].set(last)


def _draft_catch_up(draft, s):
    """The draft's pages with the slot before the row's last token written, as a single token
    of the target is about to write its last."""
    index = s["decode"]["index"]
    ids = jax.lax.dynamic_slice_in_dim(s["decode"]["tokens"], index - 1, 1, 1)
    return _draft_forward(draft, s, ids, index - 1, 0)[1]


def decode_loop_draft(models, scratch, params, stop, limit, drafts):
    """`decode_loop` of the target with `drafts` drafts a step from a draft model: `models` is
    `(target, draft)`; the tokens are those `decode_loop` gives."""
    model, draft = models

    def look_up(s):
        rows = s["decode"]["done"].shape[0]
        go = _room(s, limit, drafts) & _running(s, limit)
        return jnp.zeros((rows, drafts), jnp.int32), go

    return _drafting_loop(
        model,
        scratch,
        params,
        stop,
        limit,
        look_up,
        lambda s, _: _draft_tokens(draft, s, drafts),
        lambda s: _draft_catch_up(draft, s),
    )


def start_draft(models, scratch, prompt, lengths, rng, params, stop, chunk):
    """`start` of the target, and the draft model's pages of the prompts."""
    model, draft = models
    scratch = start(model, scratch, prompt, lengths, rng, params, stop, chunk)
    return _draft_prefill(draft, scratch, prompt, chunk)


def prefill_step(model, scratch, prompt, lengths):
    scratch, logits = _reset_and_prefill(model, scratch, prompt, lengths, prompt.shape[1])
    return scratch, logits


def decode_step(model, scratch, tokens):
    logits, scratch = _forward(model, scratch, tokens[:, None], 0)
    return scratch, logits


def _generate(model, scratch, prompt, lengths, rng, params, stop, limit, chunk):
    scratch = start(model, scratch, prompt, lengths, rng, params, stop, chunk)
    return decode_loop(model, scratch, params, stop, limit)


def _generate_ngram(model, scratch, prompt, lengths, rng, params, stop, limit, chunk, drafts):
    scratch = start(model, scratch, prompt, lengths, rng, params, stop, chunk)
    return decode_loop_ngram(model, scratch, params, stop, limit, drafts)


def _generate_draft(models, scratch, prompt, lengths, rng, params, stop, limit, chunk, drafts):
    scratch = start_draft(models, scratch, prompt, lengths, rng, params, stop, chunk)
    return decode_loop_draft(models, scratch, params, stop, limit, drafts)


# Each step run by a plan, and its static arguments.
# A `_masked` step takes each row's token mask (`mask=`): the steps of rows under a grammar.
STEP_FUNCTIONS = {
    "generate": (_generate, ("chunk",)),
    "start": (start, ("chunk",)),
    "decode": (decode_loop, ()),
    "start_masked": (start, ("chunk",)),
    "decode_masked": (decode_loop, ()),
    "generate_ngram": (_generate_ngram, ("chunk", "drafts")),
    "decode_ngram": (decode_loop_ngram, ("drafts",)),
}
# The steps of a target with a draft model (`jaxlm.generator.Generator` of both).
DRAFT_STEP_FUNCTIONS = {
    "generate_draft": (_generate_draft, ("chunk", "drafts")),
    "start_draft": (start_draft, ("chunk",)),
    "decode_draft": (decode_loop_draft, ("drafts",)),
}
