"""Stop strings checked inside the generation loop, on the bytes of the text generated so far.

Each row keeps the last `TAIL` bytes of its generated text (`tail`, declared scratch of the
loop); every sampled token appends its bytes (a table of each token's bytes, built once per
tokenizer) and the loop ends the row once one of its stop strings ends within them. The host
still cuts the text exactly (`jaxlm.requests.cut_at_stop`): the check here only stops the loop
early, so it must never see a stop string that the text does not hold, and may miss one (the
loop then runs on to `max_new_tokens`, as it did without it). The table is an input of every
step (`input_bytes`: about 2.5 MB for a vocabulary of 128k), beside the prompt:
- a token's bytes are exact only for tokenizers whose decoder maps each token to its own bytes
  (byte-level BPE: GPT-2's, Llama 3's, Qwen's, SmolLM's); others get no table, and no check;
- a token longer than `TOKEN_BYTES` bytes keeps its last ones and clears the tail before them,
  so that no stop string is seen across the bytes left out.
"""

from __future__ import annotations

import functools
import json
import weakref

import jax
import jax.numpy as jnp
import numpy as np

# The bytes of a token the table keeps, the most bytes a stop string may have (OpenAI's 256
# characters, in ASCII), the stop strings a request may have (OpenAI's limit), and the tail each
# row keeps. A longer stop string, or more of them, is cut by the host alone.
TOKEN_BYTES = 16
STOP_BYTES = 256
MAX_STOPS = 4
TAIL = STOP_BYTES + TOKEN_BYTES
# In `strings`, right-aligned: bytes before a stop string's first match anything.
_ANY = -2
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _byte_of_char() -> dict[str, int]:
    # The inverse of GPT-2's `bytes_to_unicode`: byte-level BPE writes each byte as one of these.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_table(tokenizer, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Each token's last `TOKEN_BYTES` bytes `[vocab, TOKEN_BYTES]` (left-aligned) and its whole
    length `[vocab]`, or None for a tokenizer whose tokens are not their own bytes. Built once
    per tokenizer."""
    if tokenizer is None:
        return None
    if tokenizer in _TABLES:
        return _TABLES[tokenizer]
    backend = tokenizer.backend
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    table = None
    if decoder.get("type") == "ByteLevel":
        table = np.zeros((vocab_size, TOKEN_BYTES), np.uint8)
        lengths = np.zeros((vocab_size,), np.int32)
        chars = _byte_of_char()
        added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        for i in range(min(vocab_size, backend.get_vocab_size())):
            piece = backend.id_to_token(i)
            if i in added:
                data = added[i].encode()
            elif piece is None or any(c not in chars for c in piece):
                data = b""
            else:
                data = bytes(chars[c] for c in piece)
            lengths[i] = len(data)
            kept = data[-TOKEN_BYTES:]
            table[i, : len(kept)] = np.frombuffer(kept, np.uint8)
        table = (table, lengths)
    _TABLES[tokenizer] = table
    return table


def input_bytes(vocab_size: int) -> int:
    """The bytes of a step's stop-string inputs: the strings, the token table, its lengths."""
    return MAX_STOPS * STOP_BYTES * 4 + vocab_size * (TOKEN_BYTES + 4)


def encode_strings(stop: tuple[str, ...]) -> np.ndarray:
    """The stop strings' UTF-8 bytes, right-aligned in `[MAX_STOPS, STOP_BYTES]` (`_ANY` before
    them); unused rows match nothing."""
    out = np.full((MAX_STOPS, STOP_BYTES), _ANY, np.int32)
    out[len(stop) :, -1] = -1  # no byte is -1
    for k, s in enumerate(stop):
        data = np.frombuffer(s.encode(), np.uint8)
        out[k, STOP_BYTES - len(data) :] = data
    return out


def advance(tail, token, strings, table, lengths):
    """Append each row's `token` `[B]` to its `tail` `[B, TAIL]` (bytes, -1 before the text);
    returns the new tail and whether a stop string of `strings` ends in the token's bytes."""
    n = lengths[token]  # [B]
    kept = jnp.minimum(n, TOKEN_BYTES)
    new = jnp.where(jnp.arange(TOKEN_BYTES) < kept[:, None], table[token].astype(jnp.int32), -1)
    # A token longer than the table keeps clears the tail, so nothing matches across its gap.
    tail = jnp.where((n > TOKEN_BYTES)[:, None], -1, tail)
    joined = jnp.concatenate([tail, new], axis=1)  # [B, TAIL + TOKEN_BYTES]
    tail = jax.vmap(lambda row, k: jax.lax.dynamic_slice(row, (k,), (TAIL,)))(joined, kept)
    # The bytes ending at each of the token's last `TOKEN_BYTES` positions: [B, J, STOP_BYTES].
    ends = TAIL - jnp.arange(TOKEN_BYTES)
    window = tail[:, ends[:, None] - STOP_BYTES + jnp.arange(STOP_BYTES)[None, :]]
    same = (window[:, :, None, :] == strings[None, None]) | (strings[None, None] == _ANY)
    hit = jnp.all(same, axis=-1) & (jnp.arange(TOKEN_BYTES) < kept[:, None])[:, :, None]
    return tail, jnp.any(hit, axis=(1, 2))
