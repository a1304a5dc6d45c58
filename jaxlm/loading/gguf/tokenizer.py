"""The tokenizer a GGUF file's metadata describes, built as llama.cpp runs it."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import tokenizers
from gguf import GGUFValueType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from jaxlm.errors import LoadError
from jaxlm.loading.gguf.reader import _FLOAT_TYPES, _INT_TYPES, _Metadata
from jaxlm.tokenizer import Tokenizer, check_chat_template

# Token types, numbered as in `gguf.TokenType`.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes of llama.cpp (`llm_tokenizer_bpe` in `src/llama-vocab.cpp`), applied one
# after another, each splitting the pieces the previous one left.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp rewrites these two with lookaheads its own regex engine can run, which take capitals
# outside ASCII for lower case; these are the originals from the models' `tokenizer.json`.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORDS_SPLIT = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


class _Pre:
    """A pre-tokenizer of llama.cpp: its regexes and the flags it sets with them."""

    def __init__(self, splits: Sequence[str], ignore_merges: bool = False, add_bos: bool = False):
        self.splits = tuple(splits)
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos


_DEFAULT_PRE = _Pre([r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"])
_LLAMA3_PRE = _Pre([_LLAMA3_SPLIT], ignore_merges=True, add_bos=True)
_PRE_TOKENIZERS = {
    "default": _DEFAULT_PRE,
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _Pre([_LLAMA3_SPLIT])),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
        _Pre([r"\p{N}", _GPT2_SPLIT]),
    ),
    **dict.fromkeys(
        [
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
        ],
        _Pre([_GPT2_SPLIT]),
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan"],
        _Pre([_QWEN2_SPLIT]),
    ),
    "falcon": _Pre([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"]),
    "deepseek-coder": _Pre(
        [
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            r"\p{N}",
        ]
    ),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _Pre([_WORDS_SPLIT])),
    "viking": _Pre([_WORDS_SPLIT, r"\p{N}"]),
    **dict.fromkeys(["glm4", "chatglm-bpe"], _Pre([_LLAMA3_SPLIT])),
    "tekken": _Pre([_TEKKEN_SPLIT], ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _Pre([_GPT4O_SPLIT])),
}


def _tokenizer(meta: _Metadata, tokens: list[str] | None, vocab_size: int) -> Tokenizer:
    path = meta.path
    model = meta.str_value("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise LoadError(
            f"{path}: unsupported tokenizer `{model}` (`tokenizer.ggml.model`); jaxlm reads "
            "`gpt2` (byte-level BPE) and `llama` (SentencePiece BPE)"
        )
    if not tokens:
        raise LoadError(f"{path}: metadata `tokenizer.ggml.tokens` is missing or empty")
    n = len(tokens)
    types = meta.array_value("tokenizer.ggml.token_type", frozenset(_INT_TYPES), None)
    if types is None:
        types = [_NORMAL] * n
    if len(types) != n:
        raise LoadError(
            f"{path}: `tokenizer.ggml.token_type` has {len(types)} entries for {n} tokens"
        )
    # llama.cpp renames empty tokens so that every token has distinct text.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    vocab = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise LoadError(
                f"{path}: `tokenizer.ggml.tokens` has `{token}` twice (ids {vocab[token]}, {i})"
            )
        vocab[token] = i

    def token_id(key: str) -> int | None:
        value = meta.int_value(key, None)
        if value is not None and not 0 <= value < n:
            raise LoadError(f"{path}: `{key}` is {value}, outside the {n} tokens")
        return value

    bos = token_id("tokenizer.ggml.bos_token_id")
    eos = token_id("tokenizer.ggml.eos_token_id")
    unk = token_id("tokenizer.ggml.unknown_token_id")
    eos_ids = []
    for key in ("eos", "eot", "eom"):
        value = token_id(f"tokenizer.ggml.{key}_token_id")
        if value is not None and value not in eos_ids:
            eos_ids.append(value)

    try:
        if model == "gpt2":
            backend, add_bos = _bpe_tokenizer(meta, vocab)
        else:
            backend, add_bos = _spm_tokenizer(meta, vocab, tokens, types, unk)
        add_bos = meta.bool_value("tokenizer.ggml.add_bos_token", add_bos)
        add_eos = meta.bool_value("tokenizer.ggml.add_eos_token", False)
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind in (_CONTROL, _UNKNOWN)
        ]
        user_defined = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED
        ]
        backend.add_special_tokens(specials)
        backend.add_tokens(user_defined)
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"{path}: cannot build the `{model}` tokenizer ({e})") from None

    first = last = []
    if add_bos:
        first = [_special_token(path, tokens, bos, "bos")]
    if add_eos:
        last = [_special_token(path, tokens, eos, "eos")]
    if first or last:
        backend.post_processor = processors.TemplateProcessing(
            single=[*first, "$A", *last],
            pair=[*first, "$A", *last, *first, "$B:1", *last],
            special_tokens=list({vocab[t]: (t, vocab[t]) for t in first + last}.values()),
        )
    if backend.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise LoadError(f"{path}: the tokenizer has more tokens than the model's vocabulary")
    template = meta.str_value("tokenizer.chat_template", None)
    if template is not None:
        check_chat_template(template, path)
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template)


def _special_token(path: pathlib.Path, tokens: list[str], token: int | None, key: str) -> str:
    if token is None:
        raise LoadError(
            f"{path}: `tokenizer.ggml.add_{key}_token` is set but `tokenizer.ggml.{key}_token_id` "
            "is missing"
        )
    return tokens[token]


def _bpe_tokenizer(meta: _Metadata, vocab: dict[str, int]) -> tuple[tokenizers.Tokenizer, bool]:
    """Byte-level BPE (`tokenizer.ggml.model` `gpt2`), and whether llama.cpp adds BOS by default."""
    path = meta.path
    pre_name = meta.str_value("tokenizer.ggml.pre", "default")
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise LoadError(f"{path}: unsupported pre-tokenizer `{pre_name}` (`tokenizer.ggml.pre`)")
    merges = []
    for text in meta.array_value("tokenizer.ggml.merges", frozenset({GGUFValueType.STRING}), []):
        # A merge is "left right"; llama.cpp looks for the space from the second character on.
        cut = text.find(" ", 1)
        if cut < 0:
            raise LoadError(f"{path}: malformed merge `{text}` in `tokenizer.ggml.merges`")
        merges.append((text[:cut], text[cut + 1 :]))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, pre.add_bos


def _spm_tokenizer(
    meta: _Metadata, vocab: dict[str, int], tokens: list[str], types: list[int], unk: int | None
) -> tuple[tokenizers.Tokenizer, bool]:
    """SentencePiece BPE (`tokenizer.ggml.model` `llama`), as llama.cpp runs it.

    llama.cpp merges the adjacent pair whose joined text is the highest-scoring token; BPE merges
    ranked by that score do the same. Characters that end up in no token become `<0xXX>` byte
    tokens.
    """
    n = len(tokens)
    scores = meta.array_value("tokenizer.ggml.scores", _FLOAT_TYPES, None)
    if scores is None:
        scores = [0.0] * n
    if len(scores) != n:
        raise LoadError(
            f"{meta.path}: `tokenizer.ggml.scores` has {len(scores)} entries for {n} tokens"
        )
    candidates = []
    for token, i in vocab.items():
        if types[i] in (_CONTROL, _UNKNOWN, _BYTE):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[i], i, cut, left, right))
    candidates.sort()
    merges = [(left, right) for *_, left, right in candidates]
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=byte_fallback,
        )
    )
    add_space_prefix = meta.bool_value("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend, True
