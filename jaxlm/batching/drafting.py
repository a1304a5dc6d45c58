"""The engine's decode call with drafts: by prompt lookup (`LLMEngine(speculative="ngram")`), or
by a draft model (`LLMEngine(speculative=draft)`).

Each row drafts from its own tokens (`jaxlm.speculative.propose`), or takes the draft model's
greedy tokens, and runs at its own pace, up
to the call's `steps` tokens (a chunk may keep a few more; the host drops those past a
request's end). A step runs every running row's last token, and where a row drafts, that row's
last token and drafts as a second group of `drafts + 1` tokens: one row a step, so that a chunk
adds `drafts + 1` columns to the step's products, not `drafts + 1` times its rows, and only while
few enough rows run that what a chunk keeps outweighs what it adds (`busiest`). Every position
is sampled with its own key, so a row's tokens are those it gives without drafts. After a
chunk that kept none of its drafts, the row waits 2, 4, ... `MAX_BACKOFF` tokens before it
drafts again; the wait carries over from call to call (`SequenceState.draft_wait`).

A draft model keeps pages of its own under the same page table, and runs only for the row
that drafts: over the row's tokens its pages do not hold yet (`SequenceState.draft_len`, the
whole prompt the first time) and its last token, then one token at a time for the drafts.
Steps where no row drafts (a full engine, requests that do not draft) never run it.

Steps with a chunk and steps without are two `while_loop`s, not a `lax.cond`, whose branches
XLA:CPU gives copies of the pages (`docs/performance.md`, "Speculative decoding").
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp

from jaxlm import ops
from jaxlm.batching.sampled import PACKED, pack, sample, sample_drafts
from jaxlm.speculative import MAX_BACKOFF, kept, propose

# The columns up to which a step's products cost about the same as one (they read the weights
# once), and the share of its drafts a chunk keeps on text that repeats (2 of 3): the cost
# model of `busiest`, where a draft model's token costs a model's step times its share of the
# model's bytes.
FLAT_COLUMNS = 8
KEPT_SHARE = fractions.Fraction(2, 3)


def busiest(rows: int, drafts: int, draft_cost: float = 0.0) -> int:
    """The most running rows at which a step of `rows` still runs a chunk: its `drafts + 1`
    columns, and with a draft model (`draft_cost`: its bytes over the model's) the draft
    model's tokens, cost a share of the step that the tokens it keeps must exceed, spread over
    the running rows; a lone row drafts (`docs/performance.md`, "Speculative decoding")."""
    step, more = max(rows, FLAT_COLUMNS), max(rows + drafts + 1, FLAT_COLUMNS)
    extra = more - step + drafts * draft_cost * FLAT_COLUMNS
    return rows if extra == 0 else max(1, int(KEPT_SHARE * drafts * step / extra))


# The widths a draft model catches up with a row's tokens its pages lack, widest first while
# more remain (a prompt's), and the last: its last token and the one before, which it drafts
# from. Its products cost more with every column, so a few tokens take a narrow chunk.
CATCH_UP = (64, 8)
LAST = 2


def forward(model, groups, pages):
    """The model's logits of `groups` over its pages, and every page: a draft model's
    (`pages["draft"]`) as they were."""
    logits, out = model.forward_paged(groups, pages)
    return logits, {**pages, **out}


def _draft_tokens(draft, history, table, pages, start, position, drafts: int):
    """The draft model's `drafts` greedy tokens after the token at `position` of the row whose
    tokens are `history` and whose pages `table` lists, and its pages with the row's tokens
    from `start` (the first they lack) to `position` and every draft but the last written."""
    end, most = position + 1, history.shape[0] - 1

    def run(pages, ids, at, width, count):
        # `count` tokens from position `at` in a chunk of `width`; the logits of the last.
        positions = at + jnp.arange(width, dtype=jnp.int32)
        group = dict(
            input_ids=ids(positions)[None],
            positions=jnp.where(positions < at + count, positions, -1)[None],
            table=table[None],
            last=(count - 1)[None],
        )
        (logits,), pages = draft.forward_paged([group], pages)
        return logits[0], pages

    def stored(positions):
        return history[jnp.minimum(positions, most)]

    at = start
    for width in (*CATCH_UP, LAST):

        def catch_up(c, width=width):
            return run(c[0], stored, c[1], width, jnp.int32(width))[1], c[1] + width

        pages, at = jax.lax.while_loop(lambda c, w=width: end - c[1] > w, catch_up, (pages, at))
    logits, pages = run(pages, stored, at, LAST, end - at)

    def next_token(j, carry):
        pages, logits, proposed = carry
        token = jnp.argmax(logits).astype(jnp.int32)
        logits, pages = run(pages, lambda _: token[None], end + j, 1, jnp.int32(1))
        return pages, logits, proposed.at[j].set(token)

    start = (pages, logits, jnp.zeros((drafts,), jnp.int32))
    pages, logits, proposed = jax.lax.fori_loop(0, drafts - 1, next_token, start)
    return proposed.at[drafts - 1].set(jnp.argmax(logits).astype(jnp.int32)), pages


def decode_with_drafts(
    models, x, pages, *, drafts: int, decode_steps: int, vocab_size: int, draft_cost: float
):
    """Up to `x["steps"]` tokens of each row of `x["decode"]`, `drafts` drafted at a time
    where a row may (`x["drafting"]`) within the slots its pages hold (`x["limit"]`), by prompt
    lookup, or where `models` is `(model, draft)` with a draft model, by its greedy tokens.
    Returns the pages and the packed tokens `[decode_steps + drafts + 1, rows, PACKED]`: row
    `r`'s `i`-th token at `[i, r]` (-1 past its last), and in the last entry each row's drafted
    and accepted counts, its wait and backoff, and the slots the draft model's pages hold."""
    model, draft = models
    decode = x["decode"]
    rows = decode["positions"].shape[0]
    r, cols = jnp.arange(rows), jnp.arange(drafts + 1, dtype=jnp.int32)
    most = decode_steps + drafts
    live = decode["positions"][:, 0] >= 0

    def plan(c):
        active = live & (c["count"] < x["steps"]) & ~c["stopped"]
        if draft is None:
            start = jnp.zeros((rows,), jnp.int32)
            proposed, found = propose(c["history"], start, c["pos"], drafts)
        else:
            # The draft model drafts for any row, in `chunk`.
            proposed, found = c["drafts"], jnp.ones((rows,), bool)
        room = c["pos"] + drafts < x["limit"]
        can = active & x["drafting"] & found & room & (c["wait"] == 0)
        can &= jnp.sum(active) <= busiest(rows, drafts, draft_cost)
        # The row that has run the fewest tokens drafts: rows take turns.
        pick = jnp.argmin(jnp.where(can, c["count"], jnp.iinfo(jnp.int32).max))
        return {**c, "active": active, "drafts": proposed, "pick": pick, "can": jnp.any(can)}

    def last(c):
        return c["history"][r, jnp.maximum(c["pos"], 0)]

    def generated(c):
        return x["generated"] + c["count"]

    def keep(c, sampled, n, drafted):
        # Record each row's first `n` tokens of `sampled` [rows, W], up to its first stop token.
        token, w = sampled[0], sampled[0].shape[1]
        j = cols[None, :w]
        stop = x["stops"][r[:, None], token] & (j < n[:, None])
        n = jnp.minimum(n, jnp.min(jnp.where(stop, j, w), axis=1) + 1)
        taken = j < n[:, None]
        packed = jax.vmap(pack, in_axes=1, out_axes=1)(sampled)
        at = jnp.where(taken, c["count"][:, None] + j, most)
        slot = jnp.where(taken, c["pos"][:, None] + 1 + j, c["history"].shape[1])
        seen = jnp.where(taken, token, vocab_size)
        c = {
            **c,
            "out": c["out"].at[at, r[:, None]].set(packed, mode="drop"),
            "history": c["history"].at[r[:, None], slot].set(token, mode="drop"),
            "seen": c["seen"].at[r[:, None], seen].set(True, mode="drop"),
            "pos": c["pos"] + n,
            "count": c["count"] + n,
            "stopped": c["stopped"] | jnp.any(stop & taken),
            "wait": jnp.maximum(c["wait"] - n, 0),
            "drafted": c["drafted"] + drafted,
            "accepted": c["accepted"] + jnp.where(drafted > 0, n - 1, 0),
        }
        return c

    def single(c):
        positions = jnp.where(c["active"], c["pos"], -1)[:, None]
        group = {**decode, "input_ids": last(c)[:, None], "positions": positions, "last": None}
        (logits,), pages = forward(model, [group], c["pages"])
        sampled = sample(logits[:, 0], x, generated(c), lambda: c["seen"], lambda: x["counts"])
        c = keep({**c, "pages": pages}, [a[:, None] for a in sampled], c["active"], 0)
        return plan(c)

    def chunk(c):
        pick, active = c["pick"], c["active"]
        picked = r == pick
        positions = jnp.where(active & ~picked, c["pos"], -1)[:, None]
        group = {**decode, "input_ids": last(c)[:, None], "positions": positions, "last": None}
        table, pages, pos = decode["table"][pick], c["pages"], c["pos"][pick]
        if draft is None:
            proposed = c["drafts"][pick]
        else:
            proposed, pages["draft"] = _draft_tokens(
                draft, c["history"][pick], table, pages["draft"], c["draft_len"][pick], pos, drafts
            )
        chunk = {
            "input_ids": jnp.concatenate([last(c)[pick, None], proposed])[None],
            "positions": (c["pos"][pick] + cols)[None],
            "table": table[None],
        }
        # A step of one row runs its chunk alone: the other group would hold no token, and its
        # products would read the weights once more.
        groups = [chunk] if rows == 1 else [group, chunk]
        (*logits, chunk_logits), pages = forward(model, groups, pages)
        at = generated(c)[pick] + cols
        sampled = drafted = sample_drafts(chunk_logits, x, at[None], pick[None])
        if rows > 1:
            seen = lambda: c["seen"]
            plain = sample(logits[0][:, 0], x, generated(c), seen, lambda: x["counts"])
            # Every row's tokens [rows, drafts + 1]: the picked row's from the chunk.
            sampled = [
                jnp.where(picked.reshape(rows, *[1] * a.ndim), d, a[:, None])
                for a, d in zip(plain, drafted, strict=True)
            ]
        keeps = kept(drafted[0], proposed[None])[0]
        # The draft model's pages hold the row's last token and the drafts kept, but the last.
        draft_len = c["draft_len"].at[pick].set(pos + 1 + jnp.minimum(keeps, drafts - 1))
        n = jnp.where(picked, keeps + 1, active)
        c = keep(
            {**c, "pages": pages, "draft_len": draft_len}, sampled, n, jnp.where(picked, drafts, 0)
        )
        # A chunk that kept no draft cost more than the token it gave: the row waits twice as
        # long as last time before it drafts again; one that kept a draft resets the wait.
        missed = keeps == 0
        backoff = jnp.where(missed, jnp.minimum(2 * c["backoff"][pick], MAX_BACKOFF), 1)
        c["backoff"] = c["backoff"].at[pick].set(backoff)
        c["wait"] = c["wait"].at[pick].set(jnp.where(missed, backoff, 0))
        return plan(c)

    # Every iteration of each loop gives every active row a token or more, and a row is active
    # for at most `steps` tokens: no loop runs more than `most` times.
    def body(c):
        c = ops.while_loop(lambda c: jnp.any(c["active"]) & ~c["can"], single, c, most)
        return ops.while_loop(lambda c: c["can"], chunk, c, most)

    zeros = jnp.zeros((rows,), jnp.int32)
    c = plan(
        dict(
            pages=pages,
            history=x["history"],
            seen=x["seen"],
            pos=decode["positions"][:, 0],
            count=zeros,
            stopped=jnp.bool_(False),
            out=jnp.full((most + 1, rows, PACKED), -1, jnp.int32),
            wait=x["wait"],
            backoff=x["backoff"],
            drafted=zeros,
            accepted=zeros,
            drafts=jnp.zeros((rows, drafts), jnp.int32),
            draft_len=x["draft_len"],
        )
    )
    c = ops.while_loop(lambda c: jnp.any(c["active"]), body, c, most)
    # The last entry, never a token (-2), holds each row's counts, its wait and backoff and the
    # slots the draft model's pages hold.
    counts = [jnp.full((rows,), -2, jnp.int32), c["drafted"], c["accepted"], c["wait"]]
    counts = jnp.stack([*counts, c["backoff"], c["draft_len"]], axis=1)
    return c["pages"], c["out"].at[most, :, :6].set(counts)
