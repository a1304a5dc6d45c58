"""Tokenizer: `tokenizers.Tokenizer` with the model's special tokens and chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from jaxlm.errors import LoadError


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile_template(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def check_chat_template(template, source) -> None:
    """Raise `LoadError` naming `source` unless `template` is a Jinja template that parses."""
    if not isinstance(template, str):
        raise LoadError(
            f"{source}: `chat_template` should be a string, not {type(template).__name__}"
        )
    try:
        _compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise LoadError(f"{source}: `chat_template` does not parse ({e})") from None


class Tokenizer:
    """Text to token ids and back, with the model's special tokens and chat template.

    Example:
        >>> model, tok = jaxlm.load()
        >>> ids = tok.encode("Hello")
        >>> tok.decode(ids)
        'Hello'
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ):
        self.backend = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        if not self.eos_token_ids:
            return None
        return self.backend.id_to_token(self.eos_token_ids[0])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are parsed as such.

        With `add_special_tokens`, the tokenizer's post-processor adds what the model expects
        around the text (a BOS token for Llama 2, nothing for SmolLM2).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids; bytes that do not form valid UTF-8 decode to U+FFFD.

        Ids the tokenizer does not know (a model's vocabulary may be larger) decode to nothing.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < 2**32]
        if bad:
            raise ValueError(f"token ids must be in [0, 2**32), got {bad}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render `messages` with the model's chat template, as Hugging Face renders it."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no `chat_template`; pass a plain prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer | None:
        """The tokenizer of a Hugging Face model directory, or `None` if it has no `tokenizer.json`.

        `eos_token_ids` (from `config.json` / `generation_config.json`) are added to the EOS token
        named in `tokenizer_config.json`.
        """
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise LoadError(f"{file}: not a valid `tokenizers` file ({e})") from None
        config = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_bytes())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise LoadError(f"{config_file}: not valid JSON ({e})") from None
            if not isinstance(config, dict):
                raise LoadError(f"{config_file}: should hold a JSON object")

        def token_id(key: str) -> int | None:
            entry = config.get(key)
            if isinstance(entry, dict):
                entry = entry.get("content")
            if entry is None:
                return None
            if not isinstance(entry, str):
                raise LoadError(f"{config_file}: `{key}` should be a token's text, got {entry!r}")
            return backend.token_to_id(entry)

        eos = list(eos_token_ids)
        named_eos = token_id("eos_token")
        if named_eos is not None and named_eos not in eos:
            eos.insert(0, named_eos)
        template, template_source = config.get("chat_template"), config_file
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            try:
                template = template_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise LoadError(f"{template_file}: not valid UTF-8 ({e})") from None
            template_source = template_file
        if isinstance(template, list):
            # Hugging Face also writes a list of named templates; the default one is the chat's.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None:
                raise LoadError(f"{config_file}: `chat_template` has no template named `default`")
        if template is not None:
            check_chat_template(template, template_source)
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_ids=eos,
            chat_template=template,
        )
