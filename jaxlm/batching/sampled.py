"""A step's sampling stage, and its output packed in one int32 array.

Each row's logits are penalized, biased and masked as its request asks, then sampled with the
row's key for its position (`jaxlm.sampling`); with log-probabilities asked, the chosen token's
and the `TOP_LOGPROBS` most likely tokens' come back beside it, every float as its bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import sampling

# The most alternatives a request can ask log-probabilities of, as OpenAI allows.
TOP_LOGPROBS = 20
# A step's output per row, packed in one int32 array: the token, its log-probability, the ids
# of the `TOP_LOGPROBS` most likely tokens and their log-probabilities (floats as bits).
PACKED = 2 + 2 * TOP_LOGPROBS
# The most entries of a request's `logit_bias`, which a step takes as a fixed-shape list of ids
# and values.
MAX_LOGIT_BIAS = 300


def sample(logits, x, generated, seen, counts):
    """Each row's next token, and with `x["logprobs"]`, its log-probabilities (else zeros).

    The logits are penalized (repetition, then presence and frequency), biased and masked by
    the rows' grammars in that order; each stage runs only where some row asks for it. `seen`
    and `counts` are functions that give each row's tokens seen (`[rows, V]` bool) and its
    generated tokens' counts (`[rows, V]` int32): they are called inside their stage, so a
    caller may build them there."""
    params, penalties = x["params"], x["penalties"]
    penalty = params["repetition_penalty"]
    presence, frequency = penalties["presence"], penalties["frequency"]
    keep = lambda v: v
    penalized = jax.lax.cond(
        jnp.any(penalty != 1.0),
        lambda v: sampling.penalize_seen(v, seen(), penalty),
        keep,
        logits,
    )
    penalized = jax.lax.cond(
        jnp.any((presence != 0) | (frequency != 0)),
        lambda v: sampling.penalize_counts(v, counts(), presence, frequency),
        keep,
        penalized,
    )
    penalized = jax.lax.cond(
        jnp.any(x["bias_ids"] < logits.shape[-1]),
        lambda v: sampling.add_bias(v, x["bias_ids"], x["bias"]),
        keep,
        penalized,
    )
    penalized = jax.lax.cond(
        x["masked"], lambda v: sampling.apply_bitmask(v, x["mask"]), keep, penalized
    )
    return _draw(logits, penalized, x["params"], x["keys"], generated, x["logprobs"])


# The inputs of `sample` that hold a value per row.
_PER_ROW = ("params", "penalties", "keys", "bias_ids", "bias", "mask")


def sample_positions(logits, x, generated, seen, counts):
    """`sample` at `K` positions of each row: `logits` `[R, K, V]`, `x` of `R` rows, `generated`
    `[R, K]` (each position's count of tokens before it); `seen` and `counts` give `[R * K, V]`
    arrays, row `r`'s position `k` at `r * K + k`; each output `[R, K, ...]`.

    The positions are rows of one batch, not a `vmap` of `sample`: under `vmap` the conditions
    that skip a sort or a stage depend on the batched logits, and XLA runs both branches."""
    r, k, v = logits.shape
    per = lambda a: jnp.repeat(a, k, axis=0)
    rows = {name: jax.tree.map(per, x[name]) for name in _PER_ROW}
    flat = logits.reshape(r * k, v)
    out = sample(flat, {**x, **rows}, generated.reshape(-1), seen, counts)
    return tuple(o.reshape(r, k, *o.shape[1:]) for o in out)


def sample_drafts(logits, x, generated, row, ids, seen, counts):
    """`sample_positions` at a chunk of one row (`row` `[1]`, an index into `x`'s rows):
    `logits` `[1, K, V]` after each of the chunk's tokens `ids` `[K]`, its last token and its
    drafts. Each position is penalized by the row's tokens `seen` and generated tokens'
    `counts` (`[V]` each, its last token in them) and by the drafts up to it."""
    picked = {name: jax.tree.map(lambda a: a[row], x[name]) for name in _PER_ROW}
    k, v = ids.shape[0], logits.shape[-1]

    def drafted():
        # [K, V]: the drafts up to each position, built inside the penalty stages that read
        # them, so that a chunk without penalties never fills a vocabulary-wide array.
        j = jnp.arange(k)
        upto = (j[None, :] >= 1) & (j[None, :] <= j[:, None])
        at = jnp.where(upto, ids[None, :], v)
        return jnp.zeros((k, v), jnp.int32).at[j[:, None], at].add(1, mode="drop")

    return sample_positions(
        logits,
        {**x, **picked},
        generated,
        lambda: seen[None] | (drafted() > 0),
        lambda: counts[None] + drafted(),
    )


def _draw(logits, penalized, params, keys, generated, logprobs):
    # As `generate` keys its rows: a request's `n`-th token from `fold_in(key, n)`.
    keys = jax.vmap(jax.random.fold_in)(keys, generated)
    token = sampling.sample(
        penalized, keys, params["temperature"], params["top_k"], params["top_p"], params["min_p"]
    )
    return token, *jax.lax.cond(logprobs, _logprobs, _no_logprobs, logits, token)


def pack(sampled) -> jax.Array:
    token, chosen, ids, top = sampled
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([token[:, None], bits(chosen)[:, None], ids, bits(top)], axis=1)


def _logprobs(logits, token):
    """Each row's log-probability of `token` and its `TOP_LOGPROBS` most likely tokens, from the
    model's own distribution (before any penalty, temperature or filter), as OpenAI reports them."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    return chosen, ids, top


def _no_logprobs(logits, token):
    rows = logits.shape[0]
    return (
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, TOP_LOGPROBS), jnp.int32),
        jnp.zeros((rows, TOP_LOGPROBS), jnp.float32),
    )


def unpack(out: np.ndarray):
    """The steps a call ran, each `(tokens, logprobs, top ids, top logprobs)` per row; a row
    without a token in a step (a step with drafts ran further in others) has token -1."""
    for step in out[(out[:, :, 0] >= 0).any(axis=1)]:
        ids = step[:, 2 : 2 + TOP_LOGPROBS]
        top = step[:, 2 + TOP_LOGPROBS :].view(np.float32)
        yield step[:, 0], step[:, 1].view(np.float32), ids, top
