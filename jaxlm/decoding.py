"""`generate`'s steps: prefill, the first token, and the decode loop of the engine's calls
(`jaxlm.batching.loop`, plain and with drafts) over a plan's scratch (`jaxlm.generator` jits
them as steps).

The rows keep their state in the `"decode"` part of the scratch:
- `tokens[b, p]` is the token at position `p` of row `b`, as in the engine's rows: its prompt of
  `prompt_len[b]` tokens, then its generated tokens; row `b` has sampled `sampled[b]` of them
  (its stop token, and a chunk's tokens past the `limit`, among them: the host cuts them). The
  last has not been fed to the model yet.
- `index` counts the tokens a plan's raw decode steps ran after the prompts.
- `done[b]` is set once a stop token is sampled or a stop string is complete.
- `rng[b]` is row `b`'s key; the key of its `n`-th token is `fold_in(rng[b], n)`, so a row's
  samples depend neither on the other rows nor on how a stream is cut into chunks.
- `tail[b]` holds the last bytes of row `b`'s generated text, so that the loop ends a row at a
  stop string (`jaxlm.stops`).
- `drafted`, `accepted`, `wait`, `backoff` and `draft_len` are the row's drafting counts
  (`jaxlm.batching.loop`), carried from one call of a stream to the next.

A step's `stops` are the stop token ids, padded with -1, and the stop strings with the table of
each token's bytes that the loop reads them with (`jaxlm.stops`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import stops
from jaxlm.batching import loop
from jaxlm.batching.sampled import sample
from jaxlm.memory import ScratchSpec
from jaxlm.sharding import weights_bytes

# The most slots of a page in `generate`'s plans: a row's pages are its own, so large pages only
# make the gather of a row's keys and values cheaper, down to the 256 slots attention reads at
# least (`jaxlm.ops.attend_paged`).
PAGE_SLOTS = 256


class DecodeState(nnx.Module):
    """The generation loop's own scratch, declared like the model's pages."""

    def __init__(self):
        self.tokens = ScratchSpec(
            ("batch", "seq"), jnp.int32, axes=("batch", None), doc="token at each position"
        )
        self.prompt_len = ScratchSpec(("batch",), jnp.int32, axes=("batch",), doc="prompt length")
        self.index = ScratchSpec((), jnp.int32, doc="raw decode steps run")
        self.rng = ScratchSpec(("batch", 2), jnp.uint32, axes=("batch", None), doc="PRNG key")
        self.done = ScratchSpec(("batch",), jnp.bool_, axes=("batch",), doc="stop token seen")
        self.sampled = ScratchSpec(("batch",), jnp.int32, axes=("batch",), doc="tokens sampled")
        self.tail = ScratchSpec(
            ("batch", stops.TAIL), jnp.int32, axes=("batch", None), doc="last bytes of the text"
        )
        self.drafted = ScratchSpec(("batch",), jnp.int32, axes=("batch",), doc="tokens drafted")
        self.accepted = ScratchSpec(
            ("batch",), jnp.int32, axes=("batch",), doc="drafted tokens kept"
        )
        for name in loop.COUNTS:
            setattr(self, name, ScratchSpec(("batch",), jnp.int32, axes=("batch",), doc=name))


def _forward(model, scratch, ids, positions, last):
    """Run `ids` `[B, T]` at `positions` (-1: padding, not written) over the rows' pages, as
    the engine's steps do; returns the logits of each row's column `last` `[B]` and the scratch
    with the pages written."""
    group = dict(input_ids=ids, positions=positions, table=_table(scratch), last=last)
    (logits,), pages = loop.forward(model, [group], {"model": scratch["model"]})
    return logits, {**scratch, **pages}


def _table(scratch):
    """Each row's pages: row `b` owns pages `b * per_row ..`, in order (`page_count`)."""
    num_pages = scratch["model"]["layers"][0]["self_attn"]["k_pages"].shape[0]
    b = scratch["decode"]["tokens"].shape[0]
    return jnp.arange(num_pages, dtype=jnp.int32).reshape(b, num_pages // b)


def page_count(batch: int, seq: int) -> tuple[int, int]:
    """`(num_pages, page_size)` of a plan of `batch` rows of `seq` slots: each row's slots in
    pages of at most `PAGE_SLOTS`, as evenly as they split, and at least two pages in all: XLA
    drops a unit dimension of one page with a bitcast between the pages' update and their
    read, and then copies the pages every step."""
    per_row = max(-(-seq // PAGE_SLOTS), 2 if batch == 1 else 1)
    return batch * per_row, -(-seq // per_row)


def _reset_and_prefill(model, scratch, prompt, lengths, chunk):
    """Reset the rows to `prompt` `[B, P]` (row `b`'s first `lengths[b]` tokens) and run it in
    chunks of `chunk`; returns the scratch and each row's logits of its last token."""
    b, p = prompt.shape
    d = {**scratch["decode"], "index": jnp.int32(0), "prompt_len": lengths.astype(jnp.int32)}
    state = {**scratch, "decode": d}
    last = lengths - 1
    columns = jnp.arange(chunk, dtype=jnp.int32)

    def run(i, carry):
        state, logits = carry
        at = i * chunk
        ids = jax.lax.dynamic_slice(prompt, (0, at), (b, chunk))
        positions = jnp.where(at + columns < lengths[:, None], at + columns, -1)
        new, state = _forward(model, state, ids, positions, jnp.clip(last - at, 0, chunk - 1))
        # A row's logits come from the chunk that holds its last token.
        return state, jnp.where(((last >= at) & (last < at + chunk))[:, None], new, logits)

    logits0 = jnp.zeros((b, model.config.vocab_size), jnp.float32)
    n_chunks = p // chunk
    if n_chunks == 1:
        return run(0, (state, logits0))
    return jax.lax.fori_loop(0, n_chunks, run, (state, logits0))


def _inputs(model, scratch, params, stop, limit, mask):
    """The inputs of `jaxlm.batching.loop`'s calls over the rows of `scratch`: each row's pages,
    last position (-1 once done), sampling settings and key, its stops, and `limit` tokens
    sampled at most (the host cuts those past it)."""
    d = scratch["decode"]
    b, s = d["tokens"].shape
    vocab = model.config.vocab_size
    position = _last(d)
    ids = jnp.where(stop["ids"] >= 0, stop["ids"], vocab)
    return dict(
        params,
        decode=dict(
            table=_table(scratch),
            positions=jnp.where(d["done"], -1, position)[:, None],
        ),
        keys=d["rng"],
        generated=d["sampled"],
        masked=jnp.bool_(mask is not None),
        mask=jnp.zeros((b, -(-vocab // 32)), jnp.int32) if mask is None else mask,
        logprobs=jnp.bool_(False),
        steps=limit - d["sampled"],
        stops=jnp.zeros((b, vocab), bool).at[:, ids].set(True, mode="drop"),
        drafting=jnp.ones((b,), bool),
        limit=jnp.full((b,), s, jnp.int32),
        **stop,
    )


def _last(d):
    """Each row's position of its last token: the last of its prompt before it samples any."""
    return d["prompt_len"] + d["sampled"] - 1


def _counts(tokens, first, end, vocab):
    """Each row's tokens from position `first` up to `end` (`[B]` each), counted: `[B, V]`."""
    every = jnp.arange(tokens.shape[1])
    valid = (every >= first[:, None]) & (every < end[:, None])
    ids = jnp.where(valid, tokens, vocab)
    rows = jnp.arange(tokens.shape[0])[:, None]
    return jnp.zeros((tokens.shape[0], vocab), jnp.int32).at[rows, ids].add(1, mode="drop")


def _carry(model, scratch, x, drafts):
    """`jaxlm.batching.loop`'s carry of the rows of `scratch`: their pages, tokens and counts,
    the tokens each has seen where a row has a `repetition_penalty` and those it generated
    where a row has OpenAI's penalties."""
    d = scratch["decode"]
    b = d["tokens"].shape[0]
    vocab = model.config.vocab_size
    last = _last(d)
    penalties = x["penalties"]
    seen = jax.lax.cond(
        jnp.any(x["params"]["repetition_penalty"] != 1.0),
        lambda: _counts(d["tokens"], jnp.zeros((b,), jnp.int32), last + 1, vocab) > 0,
        lambda: jnp.zeros((b, vocab), bool),
    )
    counts = jax.lax.cond(
        jnp.any((penalties["presence"] != 0) | (penalties["frequency"] != 0)),
        lambda: _counts(d["tokens"], d["prompt_len"], last + 1, vocab),
        lambda: jnp.zeros((b, vocab), jnp.int32),
    )
    pages = {name: scratch[name] for name in ("model", "draft") if name in scratch}
    return loop.carry(
        pages,
        d["tokens"][jnp.arange(b), last],
        last,
        seen=seen,
        counts=counts,
        drafts=drafts,
        carried={name: d[name] for name in loop.COUNTS},
        history=d["tokens"],
        tail=d["tail"],
    )


def _store(scratch, c):
    """`scratch` with the rows' state from the carry `c` of a call."""
    d = scratch["decode"]
    d = {
        **d,
        "tokens": c["history"],
        "sampled": d["sampled"] + c["count"],
        "done": d["done"] | c["done"],
        "tail": c["tail"],
        "drafted": d["drafted"] + c["drafted"],
        "accepted": d["accepted"] + c["accepted"],
        **{name: c[name] for name in loop.COUNTS},
    }
    return {**scratch, **c["pages"], "decode": d}


def start(model, scratch, prompt, lengths, rng, params, stop, chunk, mask=None):
    """Prefill the prompts and sample each row's first token (among those `mask` allows); a
    row of no prompt (`lengths` 0: padding) is done."""
    scratch, logits = _reset_and_prefill(model, scratch, prompt, lengths, chunk)
    b = prompt.shape[0]
    d = scratch["decode"]
    zeros = jnp.zeros((b,), jnp.int32)
    d = {
        **d,
        "tokens": jax.lax.dynamic_update_slice(d["tokens"], prompt, (0, 0)),
        "rng": rng,
        "done": lengths == 0,
        "sampled": zeros,
        "tail": jnp.full(d["tail"].shape, -1, jnp.int32),
        **{name: zeros for name in ("drafted", "accepted", "wait", "draft_len")},
        "backoff": zeros + 1,
    }
    scratch = {**scratch, "decode": d}
    x = _inputs(model, scratch, params, stop, jnp.int32(1), mask)
    c = _carry(model, scratch, x, 0)
    sampled = sample(logits, x, x["generated"], lambda: c["seen"], lambda: c["counts"])
    c = loop.record(x, c, [a[:, None] for a in sampled], (lengths > 0).astype(jnp.int32))
    return _store(scratch, c)


def decode_loop(models, scratch, params, stop, limit, mask=None, drafts=0):
    """Decode until every row is done or has sampled `limit` tokens; with a `mask`, each token
    among those it allows (a grammar's mask holds for one token: the host gives the next `limit`
    one more than the tokens sampled); with `drafts`, that many drafted a step where a row
    drafts, by prompt lookup, or by the draft model where `models` is `(model, draft)`."""
    model, draft = models if isinstance(models, tuple) else (models, None)
    x = _inputs(model, scratch, params, stop, limit, mask)
    c = _carry(model, scratch, x, drafts)
    cost = 0.0 if draft is None else weights_bytes(draft) / weights_bytes(model)
    most = scratch["decode"]["tokens"].shape[1]
    c = loop.decode((model, draft), x, c, drafts=drafts, most=most, draft_cost=cost, halt=False)
    return _store(scratch, c)


def prefill_step(model, scratch, prompt, lengths):
    return _reset_and_prefill(model, scratch, prompt, lengths, prompt.shape[1])


def decode_step(model, scratch, tokens):
    d = scratch["decode"]
    positions = (d["prompt_len"] + d["index"])[:, None]
    logits, scratch = _forward(model, scratch, tokens[:, None], positions, jnp.zeros_like(tokens))
    return {**scratch, "decode": {**d, "index": d["index"] + 1}}, logits


def _generate(models, scratch, prompt, lengths, rng, params, stop, limit, chunk, drafts=0):
    model = models[0] if isinstance(models, tuple) else models
    scratch = start(model, scratch, prompt, lengths, rng, params, stop, chunk)
    return decode_loop(models, scratch, params, stop, limit, drafts=drafts)


# Each step run by a plan, and its static arguments.
# A `_masked` step takes each row's token mask (`mask=`): the steps of rows under a grammar.
STEP_FUNCTIONS = {
    "generate": (_generate, ("chunk",)),
    "start": (start, ("chunk",)),
    "decode": (decode_loop, ()),
    "start_masked": (start, ("chunk",)),
    "decode_masked": (decode_loop, ()),
    "generate_ngram": (_generate, ("chunk", "drafts")),
    "decode_ngram": (decode_loop, ("drafts",)),
}
# The steps of a target with a draft model (`jaxlm.generator.Generator` of both).
DRAFT_STEP_FUNCTIONS = {
    "generate_draft": (_generate, ("chunk", "drafts")),
    "start_draft": (lambda models, *args, **kwargs: start(models[0], *args, **kwargs), ("chunk",)),
    "decode_draft": (decode_loop, ("drafts",)),
}
