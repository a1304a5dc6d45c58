"""Token sampling: repetition penalty, temperature, top-k, top-p and min-p over logits.

Every function is pure JAX and jit-friendly, made to run at every step of a jitted decode loop.
Every sampling parameter is a per-row array of shape [B], traced like any other input, so a new
value never recompiles and the rows of a batch may use different settings. Randomness comes from
explicit per-row PRNG keys, so a row's draw depends only on its own logits, settings and key.

The filters follow the Hugging Face warpers (``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``, ``RepetitionPenaltyLogitsProcessor``) and are applied in their order:
temperature, top-k, top-p, min-p. A filtered token gets the logit ``-inf``.

NaN logits: the filters assume NaN-free logits and their output on a row holding a NaN is
unspecified. `sample` makes such a row visible instead of drawing from whatever the filters left:
it returns the index of the row's first NaN logit, whatever the row's settings (which is what a
greedy argmax gives).

Example:
    >>> import jax, jax.numpy as jnp
    >>> logits = jnp.array([[2.0, 1.0, 0.5, -1.0]])
    >>> keys = jax.random.split(jax.random.PRNGKey(0), 1)
    >>> sample(logits, keys, temperature=jnp.array([0.0]), top_k=jnp.array([0]),
    ...        top_p=jnp.array([1.0]), min_p=jnp.array([0.0]))
    Array([0], dtype=int32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _neg_inf(x: jax.Array) -> jax.Array:
    return jnp.array(-jnp.inf, dtype=x.dtype)


def _divide_rows(x: jax.Array, d: jax.Array) -> jax.Array:
    """``x / d[:, None]``, correctly rounded like torch and numpy."""
    # XLA rewrites a division by a broadcast into a multiplication by the reciprocal, one ulp off
    # for some values; the barrier keeps the true division, so results match transformers exactly.
    return x / lax.optimization_barrier(jnp.broadcast_to(d[:, None], x.shape))


def apply_repetition_penalty(
    logits: jax.Array, token_ids: jax.Array, valid: jax.Array, penalty: jax.Array
) -> jax.Array:
    """Penalize every token already seen, the Hugging Face way.

    For every token id seen in a row, a negative logit is multiplied by the row's penalty and any
    other logit is divided by it. A token is penalized once, however many times it was seen. Ids
    outside ``[0, V)`` are ignored.

    Args:
        logits: [B, V] float.
        token_ids: [B, L] int, the tokens seen so far (prompt and generated).
        valid: [B, L] bool, which entries of ``token_ids`` count.
        penalty: [B] float; 1.0 leaves the row unchanged.

    Returns:
        [B, V] penalized logits, same dtype as ``logits``.

    Example:
        >>> logits = jnp.array([[2.0, -2.0, 1.0]])
        >>> apply_repetition_penalty(logits, jnp.array([[0, 1, 1]]), jnp.array([[True] * 3]),
        ...                          jnp.array([2.0]))
        Array([[ 1., -4.,  1.]], dtype=float32)
    """
    B, V = logits.shape
    ids = jnp.where(valid, token_ids, V)  # [B, L]; V is out of range and dropped below.
    rows = jnp.arange(B)[:, None]  # [B, 1]
    seen = jnp.zeros((B, V), dtype=bool).at[rows, ids].set(True, mode="drop")  # [B, V]
    return penalize_seen(logits, seen, penalty)


def penalize_seen(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """`apply_repetition_penalty` with the tokens seen as a [B, V] bool mask."""
    pen = penalty.astype(logits.dtype)  # [B]
    penalized = jnp.where(logits < 0, logits * pen[:, None], _divide_rows(logits, pen))
    return jnp.where(seen, penalized, logits)


# The number of largest logits `lax.top_k` gathers before top-k and top-p look further: far
# cheaper than sorting a whole row (see `docs/performance.md`, "Sampling").
HEAD_SIZE = 256


def _thresholds(
    x: jax.Array, head: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The smallest logit top-k then top-p keep in each row, from the row's largest logits.

    Args:
        x: [B, V] logits.
        head: [B, H] the H largest logits of each row in descending order, or the whole row sorted.
        top_k: [B] int.
        top_p: [B] float.

    Returns:
        ([B, 1] threshold, [B] whether the head was long enough for it to be exact).
    """
    V = x.shape[-1]
    H = head.shape[-1]
    neg_inf = _neg_inf(x)
    k_active = (top_k > 0) & (top_k < V)  # [B]
    kth = jnp.take_along_axis(head, jnp.clip(top_k - 1, 0, H - 1)[:, None], axis=-1)  # [B, 1]
    k_threshold = jnp.where(k_active[:, None], kth, neg_inf)  # [B, 1]

    # Top-p looks at the distribution top-k leaves, normalized over the whole row.
    top = head[:, :1]  # [B, 1]
    total = jnp.sum(jnp.where(x >= k_threshold, jnp.exp(x - top), 0.0), axis=-1, keepdims=True)
    probs = jnp.where(head >= k_threshold, jnp.exp(head - top), 0.0) / total  # [B, H]
    cum = jnp.cumsum(probs, axis=-1)
    # The mass of the tokens before each one; a token is in the nucleus while that mass is < p.
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)  # [B, H]
    n = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)  # [B]
    # Comparing logits rather than probabilities keeps every token tied with the last one kept.
    last = jnp.take_along_axis(head, (n - 1)[:, None], axis=-1)  # [B, 1]
    p_active = top_p < 1.0
    p_threshold = jnp.where(p_active[:, None], last, neg_inf)  # [B, 1]

    # The nucleus ends inside the head once the head's mass reaches p.
    exact = (~k_active | (top_k <= H)) & (~p_active | (cum[:, -1] >= top_p) | (H == V))
    return jnp.maximum(k_threshold, p_threshold), exact


def _top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p, skipped when no row uses them, with a full sort only when needed."""
    V = x.shape[-1]

    def full_sort(x):
        return _thresholds(x, jnp.sort(x, axis=-1, descending=True), top_k, top_p)[0]

    def filters(x):
        if V <= HEAD_SIZE:
            threshold = full_sort(x)
        else:
            # Without the barrier, XLA folds the gathers from the head into its sort and turns
            # the fast partial sort of `lax.top_k` back into a full one.
            head = lax.optimization_barrier(lax.top_k(x, HEAD_SIZE)[0])  # [B, HEAD_SIZE]
            threshold, exact = _thresholds(x, head, top_k, top_p)
            # Rows the head serves keep its threshold, so no row depends on the others.
            threshold = lax.cond(
                jnp.all(exact),
                lambda x: threshold,
                lambda x: jnp.where(exact[:, None], threshold, full_sort(x)),
                x,
            )
        return jnp.where(x >= threshold, x, _neg_inf(x))

    active = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)
    return lax.cond(jnp.any(active), filters, lambda x: x, x)


def top_k_mask(logits: jax.Array, k: jax.Array) -> jax.Array:
    """Keep the tokens whose logit is at least the row's k-th largest; the others get ``-inf``.

    Ties at the boundary are all kept. Nothing is computed when no row uses top-k; otherwise the
    row is sorted in full only when some k exceeds `HEAD_SIZE`.

    Args:
        logits: [B, V] float.
        k: [B] int; ``k <= 0`` or ``k >= V`` keeps every token.

    Returns:
        [B, V] masked logits.

    Example:
        >>> top_k_mask(jnp.array([[3.0, 1.0, 1.0, 0.0]]), jnp.array([2]))
        Array([[  3.,   1.,   1., -inf]], dtype=float32)
    """
    return _top_k_top_p(logits, k, jnp.ones(k.shape, jnp.float32))


def top_p_mask(logits: jax.Array, p: jax.Array) -> jax.Array:
    """Keep the nucleus: the fewest most probable tokens whose probability sums to at least p.

    Every token tied in logit with the least probable token of that set is kept too, and so is
    at least one token. The others get ``-inf``. Nothing is computed when no row uses top-p;
    otherwise the row is sorted in full only when a nucleus reaches past the `HEAD_SIZE` largest
    logits.

    Args:
        logits: [B, V] float.
        p: [B] float in (0, 1]; 1.0 keeps every token.

    Returns:
        [B, V] masked logits.

    Example:
        >>> logits = jnp.log(jnp.array([[0.5, 0.2, 0.2, 0.1]]))
        >>> jnp.isfinite(top_p_mask(logits, jnp.array([0.6])))
        Array([[ True,  True,  True, False]], dtype=bool)
    """
    return _top_k_top_p(logits, jnp.zeros(p.shape, jnp.int32), p)


def min_p_mask(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Keep the tokens whose probability is at least ``min_p`` times the row's largest.

    The most probable tokens are always kept; the others get ``-inf``. No sort is needed.

    Args:
        logits: [B, V] float.
        min_p: [B] float; 0.0 keeps every token.

    Returns:
        [B, V] masked logits.

    Example:
        >>> logits = jnp.log(jnp.array([[0.5, 0.25, 0.2, 0.05]]))
        >>> jnp.isfinite(min_p_mask(logits, jnp.array([0.45])))
        Array([[ True,  True, False, False]], dtype=bool)
    """
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    ratio = jnp.exp((logits - top).astype(jnp.float32))  # [B, V], probability / top probability
    keep = (ratio >= min_p[:, None]) | (logits == top)
    return jnp.where(keep, logits, _neg_inf(logits))


def filter_logits(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
) -> jax.Array:
    """The logits `sample` draws from: divided by temperature, then top-k, top-p, min-p masked.

    Rows with ``temperature <= 0`` are divided by 1 instead (`sample` takes their argmax). Top-k
    and top-p share one pass over the `HEAD_SIZE` largest logits, with a full sort only when some
    row needs more of them, and are skipped when no row uses either.

    Args:
        logits: [B, V] float.
        temperature: [B] float.
        top_k: [B] int; ``<= 0`` or ``>= V`` is off.
        top_p: [B] float in (0, 1]; 1.0 is off.
        min_p: [B] float; 0.0 is off.

    Returns:
        [B, V] float32 filtered logits.

    Example:
        >>> x = filter_logits(jnp.array([[3.0, 1.0, 1.0, 0.0]]), jnp.array([0.5]), jnp.array([2]),
        ...                   jnp.array([1.0]), jnp.array([0.0]))
        >>> x
        Array([[  6.,   2.,   2., -inf]], dtype=float32)
    """
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    x = _divide_rows(logits.astype(jnp.float32), t)  # [B, V]
    return min_p_mask(_top_k_top_p(x, top_k, top_p), min_p)


def first_argmax(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, axis=-1)` as int32: the first index of the largest value of each row,
    or of its first NaN.

    Computed as a maximum and then the smallest index that holds it, two reductions that
    XLA:CPU vectorizes; `jnp.argmax` is one reduction of (value, index) pairs, which it runs
    element by element (see `docs/performance.md`, "Sampling").
    """
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN where a row holds one.
    hit = (logits == top) | jnp.isnan(logits)
    index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def sample(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
) -> jax.Array:
    """Draw one token per row.

    A row with ``temperature <= 0`` is greedy: the argmax of its raw logits (the first index on
    ties), whatever its other settings. Any other row draws with ``jax.random.categorical`` and
    its own key from `filter_logits`. A row holding a NaN logit returns the index of its first
    NaN. The filtering and drawing are skipped when every row is greedy.

    Args:
        logits: [B, V] float.
        keys: [B, 2] uint32, one raw ``jax.random.PRNGKey`` per row (or a [B] typed key array).
        temperature: [B] float.
        top_k: [B] int; ``<= 0`` or ``>= V`` is off.
        top_p: [B] float in (0, 1]; 1.0 is off.
        min_p: [B] float; 0.0 is off.

    Returns:
        [B] int32 token ids.

    Example:
        >>> logits = jnp.array([[0.0, 5.0, 1.0], [2.0, 1.0, 0.0]])
        >>> keys = jax.random.split(jax.random.PRNGKey(0), 2)
        >>> sample(logits, keys, temperature=jnp.array([0.0, 1.0]), top_k=jnp.array([0, 1]),
        ...        top_p=jnp.array([1.0, 1.0]), min_p=jnp.array([0.0, 0.0]))
        Array([1, 0], dtype=int32)
    """
    greedy_rows = temperature <= 0  # [B]
    greedy = first_argmax(logits)  # [B]; the first NaN if any.
    has_nan = jnp.isnan(jnp.take_along_axis(logits, greedy[:, None], axis=-1)[:, 0])  # [B]
    argmax_rows = greedy_rows | has_nan

    def draw(_):
        # Argmax rows turn their filters off, so they alone never make the batch sort.
        x = filter_logits(
            logits,
            temperature,
            jnp.where(argmax_rows, 0, top_k),
            jnp.where(argmax_rows, 1.0, top_p),
            jnp.where(argmax_rows, 0.0, min_p),
        )
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return jnp.where(argmax_rows, greedy, drawn)

    return lax.cond(jnp.all(argmax_rows), lambda _: greedy, draw, None)


def penalize_counts(
    logits: jax.Array, counts: jax.Array, presence: jax.Array, frequency: jax.Array
) -> jax.Array:
    """OpenAI's presence and frequency penalties: each token's logit less `frequency` times the
    number of times it was generated, and less `presence` once if it was at all.

    Args:
        logits: [B, V] float.
        counts: [B, V] int, how many times each token was generated.
        presence, frequency: [B] float; 0 is off, negative values favour repetition.
    """
    counts = counts.astype(logits.dtype)
    seen = (counts > 0).astype(logits.dtype)
    return (
        logits
        - frequency[:, None].astype(logits.dtype) * counts
        - presence[:, None].astype(logits.dtype) * seen
    )


def add_bias(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """`logits` with `bias[b, j]` added to token `ids[b, j]` ([B, N] each), as OpenAI's
    `logit_bias`; an id outside the vocabulary (padding) adds nothing."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].add(bias.astype(logits.dtype), mode="drop")


def apply_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """`logits` with `-inf` at every token a row's bitmask leaves out.

    Args:
        logits: [B, V] float.
        mask: [B, ceil(V / 32)] int32; token `i` is allowed where bit `i % 32` of word `i // 32`
            is set, the layout `llguidance` fills.
    """
    B, V = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, words, 32]
    allowed = bits.reshape(B, -1)[:, :V].astype(bool)
    return jnp.where(allowed, logits, _neg_inf(logits))
