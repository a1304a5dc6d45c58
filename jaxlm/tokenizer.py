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
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render `messages` with the model's chat template, as Hugging Face renders it."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no `chat_template`; pass a plain prompt instead")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
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
                config = json.loads(config_file.read_text())
            except json.JSONDecodeError as e:
                raise LoadError(f"{config_file}: not valid JSON ({e})") from None

        def token_id(entry):
            if isinstance(entry, dict):
                entry = entry.get("content")
            return None if entry is None else backend.token_to_id(entry)

        eos = list(eos_token_ids)
        named_eos = token_id(config.get("eos_token"))
        if named_eos is not None and named_eos not in eos:
            eos.insert(0, named_eos)
        template = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        return cls(
            backend,
            bos_token_id=token_id(config.get("bos_token")),
            eos_token_ids=eos,
            chat_template=template,
        )
