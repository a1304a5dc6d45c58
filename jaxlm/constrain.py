"""Constrained decoding: a request's output held to a JSON schema, a regular expression, a list
of choices or a grammar.

`Grammar` says what the output must be; `grammar_of` reads one from OpenAI's `response_format`
(or a Pydantic model). `Grammars` compiles them with `llguidance` for one model's tokenizer,
built from its `tokenizer.json`, into `Matcher`s: before each of a constrained row's tokens the
host fills the row's token bitmask (one bit per vocabulary entry), the step sets the logits of
the tokens left out to `-inf` before sampling, and the token sampled advances the matcher. The
output ends when the grammar is complete.

Example:
    >>> grammar = Grammar.json({"type": "object", "properties": {"n": {"type": "integer"}}})
    >>> engine.submit("A JSON object: ", max_new_tokens=64, response_format=grammar)
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

# The longest grammar source (a schema as JSON, a regular expression, a grammar, the choices
# together) a request may give: compiling is bounded by `llguidance`'s own limits too.
MAX_GRAMMAR_CHARS = 65536
# JSON with fixed separators and no free whitespace: a small model that may put any amount of
# whitespace between tokens often does, until it runs out of tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KINDS = ("json", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A constraint `llguidance` cannot compile or that no output can meet; the message names
    the request's field in backticks and what is unsupported."""


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a request's output must be: `kind` is `"json"` (`source` a JSON schema),
    `"regex"`, `"choice"` (a tuple of strings) or `"grammar"` (Lark, or llama.cpp's GBNF).
    `field` names the request's argument in errors."""

    kind: str
    source: Any
    field: str = "response_format"

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(
                f"`{self.field}`: a grammar's kind is one of {_KINDS}, not {self.kind!r}"
            )

    @classmethod
    def json(cls, schema: dict | bool | None = None, field: str = "response_format") -> Grammar:
        """JSON that fits `schema`; any JSON object without one."""
        return cls("json", {"type": "object"} if schema is None else schema, field)

    @classmethod
    def regex(cls, pattern: str, field: str = "response_format") -> Grammar:
        """Text that matches `pattern` whole (Rust's `regex` syntax, no look-around)."""
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, options: Sequence[str], field: str = "response_format") -> Grammar:
        """Exactly one of `options`."""
        return cls("choice", tuple(options), field)

    @classmethod
    def lark(cls, grammar: str, field: str = "response_format") -> Grammar:
        """Text of a Lark (or GBNF) `grammar`, starting at its `start` rule."""
        return cls("grammar", grammar, field)

    def _check(self) -> None:
        where = f"`{self.field}`"
        if self.kind == "choice":
            if not self.source or not all(isinstance(c, str) and c for c in self.source):
                raise GrammarError(f"{where}: the choices must be a non-empty list of strings")
            size = sum(len(c) for c in self.source)
        elif self.kind == "json":
            if not isinstance(self.source, dict | bool):
                raise GrammarError(f"{where}: a JSON schema must be an object")
            size = len(json.dumps(self.source))
        else:
            if not isinstance(self.source, str) or not self.source:
                raise GrammarError(f"{where}: the {self.kind} must be a non-empty string")
            size = len(self.source)
        if size > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"{where}: the {self.kind} has {size} characters; at most {MAX_GRAMMAR_CHARS}"
            )

    def to_llguidance(self) -> str:
        """The grammar in `llguidance`'s form (not yet checked against a tokenizer)."""
        llg = _llguidance()
        self._check()
        try:
            if self.kind == "json":
                return llg.LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
            if self.kind == "choice":
                return llg.grammar_from("choice", list(self.source))
            return llg.grammar_from(self.kind, self.source)
        except ValueError as e:
            raise GrammarError(f"`{self.field}` does not compile: {e}") from None

    def check(self) -> None:
        """Raise `GrammarError` where `llguidance` cannot compile the grammar, for any tokenizer."""
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(
            self.to_llguidance(), None, limits=_limits(llg)
        )
        if failed:
            raise GrammarError(
                f"`{self.field}` is not supported: {_one_line(messages[0] if messages else '')}"
            )


def grammar_of(response_format, field: str = "response_format") -> Grammar | None:
    """The `Grammar` of OpenAI's `response_format`: `{"type": "text"}` (none),
    `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": ...}}`;
    or a `Grammar`, a Pydantic model class or None as they are."""
    if response_format is None or isinstance(response_format, Grammar):
        return response_format
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return Grammar.json(response_format.model_json_schema(), field)
    if not isinstance(response_format, dict):
        raise GrammarError(
            f"`{field}` must be an object such as {{'type': 'json_object'}}, a `Grammar` or a "
            f"Pydantic model, got {type(response_format).__name__}"
        )
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json(None, field)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise GrammarError(f"`{field}.json_schema` must be an object with a `schema` object")
        return Grammar.json(spec.get("schema", {}), field)
    raise GrammarError(
        f"`{field}.type` must be `text`, `json_object` or `json_schema`, got {kind!r}"
    )


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError(
            "constrained decoding needs `llguidance`: pip install 'jaxlm[serve]'"
        ) from None
    return llguidance


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher, first: np.ndarray):
        self._m = matcher
        # The first token's mask, computed on the thread that submitted the request: the
        # engine's thread copies it instead of filling it.
        self.first: np.ndarray | None = first

    def advance(self, token: int) -> bool:
        """Take the token sampled; whether the output is complete (or cannot go on)."""
        self.first = None
        self._m.consume_token(int(token))
        return self._m.is_stopped()


class Grammars:
    """Compiles grammars for one model's tokenizer and fills its constrained rows' masks.

    The `llguidance` tokenizer is built from the `tokenizer.json` of `tokenizer` (its
    `tokenizers` backend) when the first grammar comes, with the model's `vocab_size` (which
    may exceed the tokenizer's) and the tokenizer's end-of-sequence tokens."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._ll = None
        self._executor = None

    def _tok(self):
        with self._lock:
            if self._ll is None:
                llg = _llguidance()
                self._ll = llg.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids) or None,
                )
                self._executor = llg.LLExecutor()
        return self._ll

    def matcher(self, grammar: Grammar) -> Matcher:
        """A new matcher at the start of `grammar`; `GrammarError` if it does not compile or
        no output can meet it."""
        llg = _llguidance()
        source = grammar.to_llguidance()
        tok = self._tok()
        # The matcher compiles the grammar; it raises nothing, but is in error if that failed.
        m = llg.LLMatcher(tok, source, log_level=0, limits=_limits(llg))
        if m.is_error():
            raise GrammarError(f"`{grammar.field}` is not supported: {_one_line(m.get_error())}")
        # The first mask: a grammar no text can meet leaves the matcher in error at once.
        first = np.frombuffer(m.compute_bitmask(), np.int32)
        if m.is_error():
            raise GrammarError(f"`{grammar.field}` cannot be met: no text matches it")
        return Matcher(m, first)

    def fill(self, rows: list[tuple[Matcher, int]], mask: np.ndarray) -> None:
        """Fill `mask` [rows, words] int32 at each matcher's row with its next tokens' bits,
        the rows in parallel on `llguidance`'s threads, without the GIL."""
        import llguidance.numpy as lln

        for m, r in rows:
            if m.first is not None:
                mask[r] = m.first[: mask.shape[1]]
        rest = [(m._m, r) for m, r in rows if m.first is None]
        if rest:
            lln.fill_next_token_bitmask_par(self._executor, rest, mask)


_GRAMMARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GRAMMARS_LOCK = threading.Lock()


def grammars_for(tokenizer, vocab_size: int) -> Grammars:
    """The one `Grammars` of `tokenizer` at `vocab_size`, shared by `generate` and every engine
    of the process: `llguidance`'s tokenizer takes a while to build and holds the vocabulary."""
    if tokenizer is None:
        raise GrammarError("`response_format` needs the model's tokenizer")
    with _GRAMMARS_LOCK:
        by_size = _GRAMMARS.setdefault(tokenizer, {})
        if vocab_size not in by_size:
            by_size[vocab_size] = Grammars(tokenizer, vocab_size)
        return by_size[vocab_size]


class GrammarRows:
    """The rows of a constrained `generate` or `stream`, each with its matcher of `grammar`: the
    tokens each has taken, and whether its output is complete."""

    def __init__(self, grammars: Grammars, grammar, n: int):
        self._grammars = grammars
        self._matchers = [grammars.matcher(grammar) for _ in range(n)]
        self._taken = np.zeros(n, np.int32)
        self._complete = np.zeros(n, bool)

    def masks(self, rows: int, done) -> np.ndarray:
        """The mask of each of `rows` rows' next token: its grammar's; every token in rows
        that have ended or hold no prompt."""
        mask = np.full((rows, -(-self._grammars.vocab_size // 32)), -1, np.int32)
        ended = done | self._complete
        self._grammars.fill([(m, i) for i, m in enumerate(self._matchers) if not ended[i]], mask)
        return mask

    def advance(self, tokens, counts, done):
        """Give each matcher the tokens it has not taken; a row whose grammar is complete ends
        at its last token. Returns the rows' counts and `done`, so cut."""
        for i, m in enumerate(self._matchers):
            while self._taken[i] < counts[i] and not self._complete[i]:
                self._complete[i] = m.advance(tokens[i, self._taken[i]])
                self._taken[i] += 1
        return np.where(self._complete, self._taken, counts), done | self._complete


def _limits(llg):
    # Errors that quote the parser's state would echo a request's whole grammar.
    return llg.LLParserLimits(verbose_errors=False)


def _one_line(message: str) -> str:
    # `llguidance`'s messages span lines, with the source quoted under a caret: one line will do.
    text = " ".join(message.split()) or "unknown error"
    return text if len(text) <= 300 else text[:300] + "..."
