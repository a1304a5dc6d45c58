"""Prompt-lookup (n-gram) drafts for the decode loops of `generate` and `LLMEngine`: tokens
copied from a row's own earlier text, proposed and checked on the device.

Each step, a row looks for the latest earlier occurrence of its last `n` tokens among its own
tokens (prompt and output; `n` from `NGRAM_SIZES`, longest first) and drafts the tokens that
followed it. The decode loop (`jaxlm.batching.loop`, `generate`'s and the engine's) runs the
row's last token and its drafts as one chunk, samples a token at every position with that
position's own key, and keeps the drafts up to the first that differs from the token sampled
before it, and that token: the row's tokens are those it gives without drafts. Much real text
repeats its input (edits, extraction, quotes), and a chunk of a few tokens costs little more
than one where reading the weights bounds a step (see `docs/performance.md`, "Speculative
decoding").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.sharding import mesh_of

# The ways `generate` and `LLMEngine` draft (their `speculative=`).
METHODS = ("ngram",)
# Tokens drafted per step unless `num_speculative_tokens` says otherwise: a chunk of 4 ran in
# 1.37x the time of one token, 5 in 2x (`docs/performance.md`, "Speculative decoding").
DRAFT = 3
# The most a step may draft: each draft is a slot of every verify chunk.
MAX_DRAFT = 16
# After a chunk that kept no draft, the loop waits 2, 4, ... up to this many tokens before it
# drafts again.
MAX_BACKOFF = 16
# The lengths of the suffix a row looks up, longest first: one token matches too often to draft
# well.
NGRAM_SIZES = (3, 2)


def drafts_of(speculative, num_speculative_tokens=None, draft_models: bool = False) -> int:
    """The tokens a step drafts for `speculative` and `num_speculative_tokens` (0 without
    drafts), or a `ValueError` that names the argument and its limit. `speculative` is a method
    of `METHODS`, None, or where `draft_models` allows, a draft model."""
    model = isinstance(speculative, nnx.Module)
    if not (speculative is None or (model and draft_models) or speculative in METHODS):
        allowed = f"one of {METHODS}" + (", a draft model" if draft_models else "")
        got = f"a model ({type(speculative).__name__})" if model else repr(speculative)
        raise ValueError(f"`speculative` must be {allowed} or None, got {got}")
    if num_speculative_tokens is None:
        return 0 if speculative is None else DRAFT
    if speculative is None:
        raise ValueError('`num_speculative_tokens` needs `speculative`, such as "ngram"')
    n = num_speculative_tokens
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n <= MAX_DRAFT:
        raise ValueError(
            f"`num_speculative_tokens` must be an integer from 1 to {MAX_DRAFT}, got {n!r}"
        )
    return int(n)


def request_drafts(speculative, engines) -> bool:
    """Whether a request drafts, by `LLMEngine.submit`'s `speculative`, on an engine that
    drafts `engines` way (`"ngram"`, its draft model, or None: not at all); a way other than
    the engine's is refused."""
    drafts_of(speculative, draft_models=True)
    if speculative is None:
        return False
    if engines is None:
        raise ValueError(
            "`speculative` needs an engine that verifies drafts: "
            'LLMEngine(..., speculative="ngram") or LLMEngine(..., speculative=draft)'
        )
    if speculative is not engines and not (isinstance(speculative, str) and speculative == engines):
        way = f"{engines!r}" if isinstance(engines, str) else "with its draft model"
        raise ValueError(f"`speculative`: this engine drafts {way}; give that, None or 'engine'")
    return True


def check_weights(model) -> None:
    """Refuse drafts for a model with 4-bit weights (uint8, `jaxlm.kernels.int4`): a step that
    verifies drafts runs a chunk where plain decoding runs one token, their logits differ in the
    last bits, and rounding each activation to one int8 digit makes that up to a whole logit,
    so the drafts would change the tokens (`docs/performance.md`, "Speculative decoding")."""
    if any(x.dtype == jnp.uint8 for x in jax.tree.leaves(nnx.state(model))):
        raise ValueError(
            "`speculative` keeps the tokens of plain decoding with float or int8 weights; this "
            'model has 4-bit weights (`quantize="int4"`), where drafts would change them'
        )


def check_draft(model, draft) -> None:
    """Refuse a draft model that cannot draft for `model`: one of another vocabulary, or one
    not on the model's mesh (or device): both run in one step, their pages in one scratch."""
    vocab = getattr(getattr(draft, "config", None), "vocab_size", None)
    if vocab != model.config.vocab_size:
        raise ValueError(
            f"`speculative`: a draft model needs the model's vocabulary of "
            f"{model.config.vocab_size} tokens (the same tokenizer), got "
            f"{'no jaxlm model' if vocab is None else f'one of {vocab}'}"
        )
    mesh, draft_mesh = mesh_of(nnx.state(model)), mesh_of(nnx.state(draft))
    if mesh != draft_mesh:
        raise ValueError(
            f"`speculative`: a draft model must lie where the model does, on {_where(mesh)}; "
            f"it lies on {_where(draft_mesh)} (`jaxlm.shard(draft, mesh)` moves it to the "
            "model's mesh)"
        )


def _where(mesh) -> str:
    if mesh is None:
        return "one device"
    return f"a mesh of {dict(mesh.shape)} over devices {[d.id for d in mesh.devices.flat]}"


def propose(tokens, index, draft: int):
    """Each row's `draft` next tokens by lookup, and whether it found any.

    `tokens` `[B, S]` are the rows' slots, row `b`'s text up to slot `index` (its last token;
    one slot for every row, or `[B]`). A row whose last `n` tokens occurred before, ending at
    slot `e - 1 < index`, drafts the tokens from slot `e` on; past `index`, where its text
    ends, it drafts the repeat that the occurrence implies (the tokens `index + 1 - e` slots
    back). Returns `(drafts [B, draft], found [B])`.
    """
    b, s = tokens.shape
    slots = jnp.arange(s, dtype=jnp.int32)
    index = jnp.broadcast_to(index, (b,))
    found = jnp.zeros((b,), bool)
    follow = jnp.zeros((b,), jnp.int32)
    for n in NGRAM_SIZES:
        at = jnp.maximum(index[:, None] - n + 1 + slots[None, :n], 0)
        suffix = jnp.take_along_axis(tokens, at, axis=1)
        windows = s - n + 1
        same = jnp.ones((b, windows), bool)
        for i in range(n):
            same &= tokens[:, i : windows + i] == suffix[:, i : i + 1]
        j = slots[:windows]
        earlier = same & (j[None, :] + n <= index[:, None])
        latest = jnp.max(jnp.where(earlier, j[None, :], -1), axis=1)
        hit = (latest >= 0) & (index - n + 1 >= 0) & ~found
        follow = jnp.where(hit, latest + n, follow)
        found |= hit
    period = jnp.maximum(index + 1 - follow, 1)
    at = follow[:, None] + jnp.arange(draft, dtype=jnp.int32)[None, :] % period[:, None]
    return jnp.take_along_axis(tokens, jnp.minimum(at, s - 1), axis=1), found


def kept(sampled, drafts):
    """How many drafts each row keeps: those up to the first that differs from the token sampled
    at its position (`sampled` `[B, drafts + 1]`, the token after each position of the chunk)."""
    same = (sampled[:, : drafts.shape[1]] == drafts).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(same, axis=1), axis=1)
