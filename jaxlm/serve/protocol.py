"""OpenAI's request and response shapes: bodies checked into engine arguments, outputs into JSON.

Every check raises `APIError` with the status, the field and a message that names its limit, so
the server answers a bad request with OpenAI's error shape and never reaches the engine with it.
Fields OpenAI defines that jaxlm does not implement are refused when they would change the
output (`echo`, `functions`, ...) and ignored when they would not (`user`); fields
OpenAI does not define are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Sequence

from jaxlm.batching.sampled import TOP_LOGPROBS
from jaxlm.constrain import Grammar, GrammarError, grammar_of
from jaxlm.outputs import RequestOutput, TokenLogprob
from jaxlm.requests import BIAS_RANGE, PENALTY_RANGE, is_int

# The most choices one request may ask for (`n`, times the prompts of a completion).
MAX_CHOICES = 16
# The most stop strings of a request, as OpenAI allows, and the longest: each new token is
# checked against the last `len(stop)` characters of the text, on the engine's thread.
MAX_STOP = 4
MAX_STOP_CHARS = 256
# The most characters of a value sent that an error message quotes, and of a message.
QUOTE_CHARS = 100
MESSAGE_CHARS = 1000

_SURROGATES = re.compile("[\ud800-\udfff]")


def quote(value) -> str:
    """`repr(value)`, cut to `QUOTE_CHARS` characters: a message never echoes a large input."""
    if isinstance(value, str | list | dict) and len(value) > QUOTE_CHARS:
        value = value[:QUOTE_CHARS] if isinstance(value, str | list) else "{...}"
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."


def _clean(text: str | None, limit: int) -> str | None:
    # A lone surrogate cannot be encoded as UTF-8: the error answering it would fail in turn.
    if text is None:
        return None
    text = _SURROGATES.sub("\ufffd", text)
    return text if len(text) <= limit else text[:limit] + "..."


class APIError(Exception):
    """An error to answer in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        message, param = _clean(message, MESSAGE_CHARS), _clean(param, QUOTE_CHARS)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status == 404:
            return "not_found_error"
        if self.status in (429, 503):
            return "server_overloaded" if self.status == 503 else "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "internal_server_error"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default, *, low=None, high=None, low_open=False, integer=False):
    """`body[name]` (or `default` where it is absent or null), checked to be a number in range."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"`{name}` must be a number, got {type(value).__name__}")
    if integer and not (is_int(value) or float(value).is_integer()):
        raise _bad(name, f"`{name}` must be an integer, got {quote(value)}")
    # An integer near or beyond a float's range counts as infinite (`float()` would raise on
    # it); NaN fails every comparison.
    if not abs(value) < 2**1023:
        raise _bad(name, f"`{name}` must be finite and below 2**1023, got {quote(value)}")
    if low is not None and (value <= low if low_open else value < low):
        raise _bad(name, f"`{name}` must be {'>' if low_open else '>='} {low}, got {quote(value)}")
    if high is not None and value > high:
        raise _bad(name, f"`{name}` must be <= {high}, got {quote(value)}")
    return int(value) if integer else float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"`{name}` must be a boolean, got {type(value).__name__}")
    return value


def _unsupported(body: dict, **off) -> None:
    """Refuse OpenAI fields that would change the output, unless they hold their no-op value."""
    for name, neutral in off.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise _bad(name, f"`{name}` is not supported by jaxlm (got {quote(value)})")


@dataclasses.dataclass
class Parsed:
    """A checked request: its prompts (text or token ids), the engine's sampling arguments,
    and how to answer."""

    prompts: list
    sampling: dict
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    max_tokens: int | None


def _common(body: dict, logprobs, max_tokens) -> tuple[dict, int, bool, bool]:
    n = _number(body, "n", 1, low=1, high=MAX_CHOICES, integer=True)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "`stream_options` must be an object")
    include_usage = _bool(options or {}, "include_usage")
    if options is not None and not stream:
        raise _bad("stream_options", "`stream_options` needs `stream: true`")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _bad("stop", "`stop` must be a non-empty string or a list of them")
    if stop is not None and len(stop) > MAX_STOP:
        raise _bad("stop", f"`stop` holds at most {MAX_STOP} strings, got {len(stop)}")
    if stop is not None and max(map(len, stop), default=0) > MAX_STOP_CHARS:
        raise _bad("stop", f"a `stop` string holds at most {MAX_STOP_CHARS} characters")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**64):
        raise _bad("seed", f"`seed` must be a 64-bit integer, got {quote(seed)}")
    _unsupported(body, functions=([],))
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise _bad("logit_bias", "`logit_bias` must map token ids to numbers")
    if logit_bias and not all(isinstance(v, int | float) for v in logit_bias.values()):
        raise _bad("logit_bias", f"`logit_bias` values must be numbers in ±{BIAS_RANGE:g}")
    penalty = dict(low=-PENALTY_RANGE, high=PENALTY_RANGE)
    top_k = _number(body, "top_k", None, integer=True, low=-1, high=2**31 - 1)
    sampling = dict(
        temperature=_number(body, "temperature", 1.0, low=0),
        top_p=_number(body, "top_p", None, low=0, high=1, low_open=True),
        top_k=None if top_k in (None, -1) else top_k,
        min_p=_number(body, "min_p", None, low=0, high=1),
        repetition_penalty=_number(body, "repetition_penalty", None, low=0, low_open=True),
        stop=stop or None,
        # vLLM's extra: generate all `max_tokens`, past the end-of-sequence tokens.
        stop_token_ids=[] if _bool(body, "ignore_eos") else None,
        seed=seed,
        logprobs=logprobs,
        presence_penalty=_number(body, "presence_penalty", 0.0, **penalty),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, **penalty),
        logit_bias=logit_bias,
        response_format=_grammar(body),
    )
    sampling["max_new_tokens"] = max_tokens
    return sampling, n, stream, include_usage


def _grammar(body: dict) -> Grammar | None:
    """The constraint of OpenAI's `response_format` or vLLM's `structured_outputs` (`json`,
    `regex`, `choice`, `grammar`, `json_object`); compiled by the engine when it is submitted."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and extra is not None:
        raise _bad("structured_outputs", "give `response_format` or `structured_outputs`, not both")
    try:
        if extra is None:
            return grammar_of(fmt)
        if not isinstance(extra, dict):
            raise _bad("structured_outputs", "`structured_outputs` must be an object")
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if k in extra]
        if len(given) != 1:
            raise _bad(
                "structured_outputs",
                "`structured_outputs` takes one of `json`, `regex`, `choice`, `grammar` and "
                "`json_object`",
            )
        kind, value = given[0], extra[given[0]]
        field = f"structured_outputs.{kind}"
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise _bad(field, f"`{field}` is not valid JSON") from None
        if kind == "choice" and not isinstance(value, list):
            raise _bad(field, f"`{field}` must be a list of strings")
        if kind == "json_object":
            return Grammar.json(None, field) if value is True else None
        return Grammar(kind, tuple(value) if kind == "choice" else value, field)
    except GrammarError as e:
        param = "structured_outputs" if extra is not None else "response_format"
        raise _bad(param, str(e)) from None


def parse_completion(body: dict) -> Parsed:
    """The body of `POST /v1/completions`."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_int(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise _bad("prompt", "`prompt` must be a string, a list of token ids or a list of such")
    for p in prompts:
        ok = isinstance(p, str) or (isinstance(p, list) and all(is_int(t) for t in p))
        if not ok or not p:
            raise _bad("prompt", "every prompt must be a non-empty string or list of token ids")
    _unsupported(body, echo=(False,), suffix=("",), best_of=(1,))
    logprobs = _number(body, "logprobs", None, low=0, high=TOP_LOGPROBS, integer=True)
    max_tokens = _number(body, "max_tokens", 16, low=1, integer=True)
    sampling, n, stream, usage = _common(body, logprobs, max_tokens)
    if n * len(prompts) > MAX_CHOICES:
        raise _bad("n", f"`n` times the prompts is at most {MAX_CHOICES}")
    return Parsed(prompts, sampling, n, stream, usage, logprobs, max_tokens)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content", "a text part's `text` must be a string")
            parts.append(part["text"])
        return "".join(parts)
    if content is None and message.get("role") == "assistant":
        return ""
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "`content` must be a string or a list of text parts")
    return content


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's `tool_calls`, checked: each a function's name and arguments."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(param, f"`{param}` must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise _bad(param, f"each of `{param}` needs `function` with `name` and `arguments`")
        call_id = call.get("id")
        out.append(
            {
                "id": call_id if isinstance(call_id, str) else new_id("call"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


def parse_chat(body: dict) -> tuple[Parsed, list[dict]]:
    """The body of `POST /v1/chat/completions`, and its messages as the chat template takes
    them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "`messages` must be a non-empty list")
    out, names = [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "a message must be an object with a string `role`")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role", f"unsupported role {quote(m['role'])}")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": _content(m, i)}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
            names.update((c["id"], c["function"]["name"]) for c in message["tool_calls"])
        if role == "tool":
            call = m.get("tool_call_id")
            if not isinstance(call, str):
                raise _bad(f"messages[{i}].tool_call_id", "a tool message needs `tool_call_id`")
            message.update(tool_call_id=call, name=names.get(call, call))
        out.append(message)
    want = _bool(body, "logprobs")
    top = _number(body, "top_logprobs", None, low=0, high=TOP_LOGPROBS, integer=True)
    if top is not None and not want:
        raise _bad("top_logprobs", "`top_logprobs` needs `logprobs: true`")
    name = "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
    max_tokens = _number(body, name, None, low=1, integer=True)
    logprobs = (top or 0) if want else None
    sampling, n, stream, usage = _common(body, logprobs, max_tokens)
    return Parsed([None], sampling, n, stream, usage, logprobs, max_tokens), out


# Responses.


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(output: RequestOutput) -> str:
    # A request cancelled while its client still listens was cut by the server's shutdown:
    # vLLM says `abort` then.
    return {"length": "length", "cancelled": "abort"}.get(output.finish_reason, "stop")


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, logprobs: Sequence[TokenLogprob], offset: int) -> dict:
    """The `logprobs` of a completion choice (or of a streamed piece starting at `offset`)."""
    tokens = [_token_text(tokenizer, t.token_id) for t in logprobs]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [{_token_text(tokenizer, i): p for i, p in t.top} for t in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, logprobs: Sequence[TokenLogprob]) -> dict:
    """The `logprobs` of a chat choice: one entry per token, with its bytes and alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, p) for i, p in t.top]}
            for t in logprobs
        ]
    }
