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


def sample(logits, x, generated, seen):
    """Each row's next token, and with `x["logprobs"]`, its log-probabilities (else zeros).

    The logits are penalized (repetition, then presence and frequency), biased and masked by
    the rows' grammars in that order; each stage runs only where some row asks for it."""
    params, penalties = x["params"], x["penalties"]
    penalty = params["repetition_penalty"]
    presence, frequency = penalties["presence"], penalties["frequency"]
    keep = lambda v: v
    penalized = jax.lax.cond(
        jnp.any(penalty != 1.0),
        lambda v: sampling.penalize_seen(v, seen, penalty),
        keep,
        logits,
    )
    penalized = jax.lax.cond(
        jnp.any((presence != 0) | (frequency != 0)),
        lambda v: sampling.penalize_counts(v, x["counts"], presence, frequency),
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


def sample_drafts(logits, x, generated, rows):
    """`sample` at the positions of a chunk of drafts of each of `rows` (indices into `x`'s
    rows): `logits` `[R, K, V]`, `generated` `[R, K]` (each position's count of tokens before
    it); each output `[R, K, ...]`.

    A row that drafts has no penalty and no grammar (the engine keeps those rows from
    drafting), so only its `logit_bias` applies. The positions are rows of one batch, not a
    `vmap` of `sample`: under `vmap` the conditions that skip a sort or a stage depend on the
    batched logits, and XLA runs both branches."""
    r, k, v = logits.shape

    def per(a):
        return jnp.repeat(a[rows], k, axis=0)

    flat = logits.reshape(r * k, v)
    biased = jax.lax.cond(
        jnp.any(x["bias_ids"] < v),
        lambda v: sampling.add_bias(v, per(x["bias_ids"]), per(x["bias"])),
        lambda v: v,
        flat,
    )
    params = {n: per(p) for n, p in x["params"].items()}
    out = _draw(flat, biased, params, per(x["keys"]), generated.reshape(-1), x["logprobs"])
    return tuple(o.reshape(r, k, *o.shape[1:]) for o in out)


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
