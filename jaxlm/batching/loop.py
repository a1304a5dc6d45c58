"""The decode loop of the engine's calls and of `generate`: tokens of every row, one a step,
and where a row drafts, by prompt lookup (`speculative="ngram"`) or by a draft model
(`speculative=draft`), its drafts checked in the same step.

Each row runs at its own pace, up to its `steps` tokens (a chunk may keep a few more: the host
drops those past a request's end), and stops at a stop token or, where the rows carry a tail of
their text, at a stop string (`jaxlm.stops`). A step runs every running row's last token, and
where a row drafts, that row's last token and drafts as a second group of `drafts + 1` tokens:
one row a step, so that a chunk adds `drafts + 1` columns to the step's products, not `drafts +
1` times its rows, and only while few enough rows run that what a chunk keeps outweighs what it
adds (`busiest`). Every position is sampled with its own key and penalized by the tokens before
it, so a row's tokens are those it gives without drafts. After a chunk that kept none of its
drafts, the row waits 2, 4, ... `MAX_BACKOFF` tokens before it drafts again; the wait carries
over from call to call.

A draft model keeps pages of its own under the same page table, and runs only for the row that
drafts: over the row's tokens its pages do not hold yet (`draft_len`, the whole prompt the first
time) and its last token, then one token at a time for the drafts. Steps where no row drafts (a
full engine, requests that do not draft) never run it.

Steps with a chunk and steps without are two `while_loop`s, not a `lax.cond`, whose branches
XLA:CPU gives copies of the pages (`docs/performance.md`, "Speculative decoding").
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp

from jaxlm import ops, stops
from jaxlm.batching.sampled import PACKED, pack, sample, sample_drafts
from jaxlm.speculative import MAX_BACKOFF, kept, propose

# The columns up to which a step's products cost about the same as one (they read the weights
# once), and the share of its drafts a chunk keeps on text that repeats (2 of 3): the cost
# model of `busiest`, where a draft model's token costs a model's step times its share of the
# model's bytes.
FLAT_COLUMNS = 8
KEPT_SHARE = fractions.Fraction(2, 3)
# A row's counts that a call carries over to the next (`decode` takes and returns them).
COUNTS = ("wait", "backoff", "draft_len")


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


def _draft_tokens(draft, stored, table, pages, start, position, drafts: int, go):
    """The draft model's `drafts` greedy tokens after the token at `position` of the row whose
    tokens `stored(positions)` gives and whose pages `table` lists, and its pages with the
    row's tokens from `start` (the first they lack) to `position` and every draft but the last
    written; where not `go`, its pages as they were."""
    end = jnp.where(go, position + 1, start)

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

    at = start
    for width in (*CATCH_UP, LAST):

        def catch_up(c, width=width):
            return run(c[0], stored, c[1], width, jnp.int32(width))[1], c[1] + width

        pages, at = jax.lax.while_loop(lambda c, w=width: end - c[1] > w, catch_up, (pages, at))
    logits, pages = run(pages, stored, at, LAST, end - at)

    def next_token(j, carry):
        pages, logits, proposed = carry
        token = jnp.argmax(logits).astype(jnp.int32)
        logits, pages = run(pages, lambda _: token[None], end + j, 1, go.astype(jnp.int32))
        return pages, logits, proposed.at[j].set(token)

    start = (pages, logits, jnp.zeros((drafts,), jnp.int32))
    pages, logits, proposed = jax.lax.fori_loop(0, drafts - 1, next_token, start)
    return proposed.at[drafts - 1].set(jnp.argmax(logits).astype(jnp.int32)), pages


def decode(
    models, x, c, *, drafts: int, most: int, draft_cost=0.0, halt=True, together=lambda p: p
):
    """Up to `x["steps"]` (`[rows]` or one for all) tokens of each live row of `x["decode"]`
    (its page tables, and position -1 where a row does not run), `drafts` drafted at a time
    where a row may (`x["drafting"]`) within the positions its pages hold (`x["limit"]`), by
    prompt lookup, or where `models` is `(model, draft)` with a draft model, by its greedy
    tokens. With `halt`, the call ends once a row stops, so that the host can give its slot to
    another; otherwise the others run on.

    `c`, the carry (`carry` makes it), holds the pages and each row's state, and optionally its
    tokens (`history`, row `r`'s position `p` at `[r, p]`; drafts need them), its packed
    samples (`out`, row `r`'s `i`-th at `[i, r]`) and the tail of its text (`tail`: it stops at
    `x["strings"]`, with `x["table"]` and `x["lengths"]`). Returns the carry at the end; no
    loop runs more than `most` times.

    `together(p)` makes a loop's condition `p` one for every shard of a mesh's `data` axis (each
    runs its own rows): the model's collectives inside the loop wait for every shard, which then
    runs as many steps as the busiest, its own rows idle where they are done."""
    model, draft = models
    rows = c["pos"].shape[0]
    r, cols = jnp.arange(rows), jnp.arange(drafts + 1, dtype=jnp.int32)
    live = x["decode"]["positions"][:, 0] >= 0

    def plan(c):
        active = live & (c["count"] < x["steps"]) & ~c["done"]
        if halt:
            active &= ~jnp.any(c["done"] & live)
        c = {**c, "active": active, "can": jnp.bool_(False)}
        if not drafts:
            return c
        if draft is None:
            proposed, found = propose(c["history"], c["pos"], drafts)
        else:
            # The draft model drafts for any row, in `chunk`.
            proposed, found = c["drafts"], jnp.ones((rows,), bool)
        room = c["pos"] + drafts < x["limit"]
        can = active & x["drafting"] & found & room & (c["wait"] == 0)
        can &= jnp.sum(active) <= busiest(rows, drafts, draft_cost)
        # The row that has run the fewest tokens drafts: rows take turns.
        pick = jnp.argmin(jnp.where(can, c["count"], jnp.iinfo(jnp.int32).max))
        return {**c, "drafts": proposed, "pick": pick, "can": jnp.any(can)}

    def generated(c):
        return x["generated"] + c["count"]

    def group(c, positions):
        return {**x["decode"], "input_ids": c["ids"][:, None], "positions": positions, "last": None}

    def single(c):
        positions = jnp.where(c["active"], c["pos"], -1)[:, None]
        (logits,), pages = forward(model, [group(c, positions)], c["pages"])
        seen, counts = (lambda: c["seen"]), (lambda: c["counts"])
        sampled = sample(logits[:, 0], x, generated(c), seen, counts)
        c = record(x, {**c, "pages": pages}, [a[:, None] for a in sampled], c["active"])
        return plan(c)

    def chunk(c):
        # A shard with no row to draft (`can`, where `together` runs it) runs a plain step.
        pick, active, go = c["pick"], c["active"], c["can"]
        picked = (r == pick) & go
        positions = jnp.where(active & ~picked, c["pos"], -1)[:, None]
        table, pages, pos = x["decode"]["table"][pick], c["pages"], c["pos"][pick]
        if draft is None:
            proposed = c["drafts"][pick]
        else:
            row, end = c["history"][pick], c["history"].shape[1] - 1
            stored = lambda positions: row[jnp.minimum(positions, end)]
            proposed, pages["draft"] = _draft_tokens(
                draft, stored, table, pages["draft"], c["draft_len"][pick], pos, drafts, go
            )
        ids = jnp.concatenate([c["ids"][pick, None], proposed])
        # A step of one row runs its chunk alone: the other group would hold no token, and its
        # products would read the weights once more. Not drafting, it runs the row's last token.
        run = go | ((cols == 0) & active[pick] & (rows == 1))
        chunk = {
            "input_ids": ids[None],
            "positions": jnp.where(run, pos + cols, -1)[None],
            "table": table[None],
        }
        groups = [chunk] if rows == 1 else [group(c, positions), chunk]
        (*logits, chunk_logits), pages = forward(model, groups, pages)
        at = generated(c)[pick] + cols
        seen, counts = c["seen"][pick], c["counts"][pick]
        sampled = drafted = sample_drafts(chunk_logits, x, at[None], pick[None], ids, seen, counts)
        if rows > 1:
            seen, counts = (lambda: c["seen"]), (lambda: c["counts"])
            plain = sample(logits[0][:, 0], x, generated(c), seen, counts)
            # Every row's tokens [rows, drafts + 1]: the picked row's from the chunk.
            sampled = [
                jnp.where(picked.reshape(rows, *[1] * a.ndim), d, a[:, None])
                for a, d in zip(plain, drafted, strict=True)
            ]
        keeps = kept(drafted[0], proposed[None])[0]
        # The draft model's pages hold the row's last token and the drafts kept, but the last.
        at_pick = lambda a, value: a.at[pick].set(jnp.where(go, value, a[pick]))
        draft_len = at_pick(c["draft_len"], pos + 1 + jnp.minimum(keeps, drafts - 1))
        n = jnp.where(picked, keeps + 1, active)
        c = {**c, "pages": pages, "draft_len": draft_len}
        c = record(x, c, sampled, n, jnp.where(picked, drafts, 0))
        # A chunk that kept no draft cost more than the token it gave: the row waits twice as
        # long as last time before it drafts again; one that kept a draft resets the wait.
        missed = keeps == 0
        backoff = jnp.where(missed, jnp.minimum(2 * c["backoff"][pick], MAX_BACKOFF), 1)
        c["backoff"] = at_pick(c["backoff"], backoff)
        c["wait"] = at_pick(c["wait"], jnp.where(missed, backoff, 0))
        return plan(c)

    # Every iteration of each loop gives every active row a token or more, and a row is active
    # for at most `steps` tokens: no loop runs more than `most` times.
    def body(c):
        # Single tokens until some shard's row drafts; the others then run plain steps beside.
        go = lambda c: together(jnp.any(c["active"])) & ~together(c["can"])
        c = ops.while_loop(go, single, c, most)
        return ops.while_loop(lambda c: together(c["can"]), chunk, c, most)

    running = lambda c: together(jnp.any(c["active"]))
    c = ops.while_loop(running, body if drafts else single, plan(c), most)
    for name in ("active", "can", "pick", "drafts"):
        c.pop(name, None)
    return c


def _tail(x, text, token, n):
    """Each row's tail of its text `text` with its first `n` tokens of `token` `[rows, W]`
    appended, and where a stop string of `x["strings"]` ends at each of them."""

    def advance(text):
        # A loop over the columns: unrolled, each column compiled a copy of the check
        # (`docs/performance.md`, "One decode loop").
        def column(text, j):
            new, end = stops.advance(text, token[:, j], x["strings"], x["table"], x["lengths"])
            return jnp.where((j < n)[:, None], new, text), end

        if token.shape[1] == 1:
            text, end = column(text, 0)
            return text, end[:, None]
        text, ends = jax.lax.scan(column, text, jnp.arange(token.shape[1]))
        return text, ends.T

    unmatched = lambda text: (text, jnp.zeros(token.shape, bool))
    return jax.lax.cond(jnp.any(x["strings"] >= 0), advance, unmatched, text)


def record(x, c, sampled, n, drafted=0):
    """The carry `c` with each row's first `n` tokens of `sampled` `[rows, W]` (`sample`'s
    outputs of `W` positions) taken, up to its first stop token or stop string, and `drafted`
    tokens drafted."""
    token, w = sampled[0], sampled[0].shape[1]
    r, j = jnp.arange(token.shape[0]), jnp.arange(w)[None, :]
    stop = x["stops"][r[:, None], token]
    if "tail" in c:
        c["tail"], ends = _tail(x, c["tail"], token, n)
        stop |= ends
    stop &= j < n[:, None]
    n = jnp.minimum(n, jnp.min(jnp.where(stop, j, w), axis=1) + 1)
    taken = j < n[:, None]
    if "out" in c:
        packed = jax.vmap(pack, in_axes=1, out_axes=1)(sampled)
        at = jnp.where(taken, c["count"][:, None] + j, c["out"].shape[0])
        c["out"] = c["out"].at[at, r[:, None]].set(packed, mode="drop")
    if "history" in c:
        slot = c["pos"][:, None] + 1 + j
        slot = jnp.where(taken, slot, c["history"].shape[1])
        c["history"] = c["history"].at[r[:, None], slot].set(token, mode="drop")
    counted = jnp.where(taken, token, c["seen"].shape[1])
    return {
        **c,
        "seen": c["seen"].at[r[:, None], counted].set(True, mode="drop"),
        "counts": c["counts"].at[r[:, None], counted].add(1, mode="drop"),
        "ids": jnp.where(n > 0, token[r, jnp.maximum(n - 1, 0)], c["ids"]),
        "pos": c["pos"] + n,
        "count": c["count"] + n,
        "done": c["done"] | jnp.any(stop & taken, axis=1),
        "wait": jnp.maximum(c["wait"] - n, 0),
        "drafted": c["drafted"] + drafted,
        "accepted": c["accepted"] + jnp.where(drafted > 0, n - 1, 0),
    }


def carry(
    pages,
    ids,
    pos,
    *,
    seen,
    counts,
    drafts=0,
    carried=None,
    history=None,
    out=None,
    tail=None,
):
    """`decode`'s carry of rows whose last tokens are `ids` at positions `pos`, with the tokens
    each has seen (`[rows, vocab]` bool) and its generated tokens' `counts`; `carried`, each
    row's `COUNTS` from the call before (zeros without); `history`, each row's tokens by position,
    `out` (`new_out`) and `tail`, where the caller has them."""
    rows = pos.shape[0]
    zeros = jnp.zeros((rows,), jnp.int32)
    carried = carried or {name: zeros for name in COUNTS}
    c = dict(pages=pages, ids=ids, pos=pos, seen=seen, counts=counts, **carried)
    optional = dict(history=history, out=out, tail=tail)
    c.update({name: a for name, a in optional.items() if a is not None})
    c.update(count=zeros, done=jnp.zeros((rows,), bool), drafted=zeros, accepted=zeros)
    c["drafts"] = jnp.zeros((rows, drafts), jnp.int32)
    return c


def out_of(c, most: int):
    """The engine's packed output of a call: its samples, and in the last entry (never a token:
    -2) each row's drafted and accepted counts and its `COUNTS`."""
    rows = c["pos"].shape[0]
    counts = [jnp.full((rows,), -2, jnp.int32), c["drafted"], c["accepted"]]
    counts = jnp.stack([*counts, *(c[name] for name in COUNTS)], axis=1)
    return c["out"].at[most, :, :6].set(counts)


def new_out(rows: int, most: int):
    """An empty `out` for `carry`: `most` entries of `PACKED` values a row, and the counts'."""
    return jnp.full((most + 1, rows, PACKED), -1, jnp.int32)
