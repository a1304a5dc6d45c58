"""Tool calls in chat completions: OpenAI's `tools` and `tool_choice` checked, rendered into the
prompt, forced by a grammar where the request demands a call, and parsed out of the output.

Rendering: a chat template that takes `tools` (Qwen's, Llama 3.1's, Mistral's, Hermes') renders
them and the history's tool calls and results itself. A template that does not (SmolLM2's) gets
the fallback: a system message that lists the functions as JSON and asks for a JSON envelope,
`{"tool_calls": [{"name": ..., "arguments": {...}}]}`; the history's assistant tool calls are
written as that envelope and tool results as user messages.

Parsing: by the model family's format, from the template (or `--tool-call-parser`): `hermes`
(`<tool_call>{...}</tool_call>`, Hermes and Qwen), `llama3_json` (a JSON object with
`parameters`, after `<|python_tag|>` or alone), `mistral` (`[TOOL_CALLS] [...]`) and `json`
(the fallback's envelope, a bare call or a list of calls).

Forcing: with `tool_choice` `required` or a named function, the output is held by a grammar to
the JSON envelope with arguments that fit the function's `parameters`, whatever the family.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxlm.constrain import Grammar, GrammarError
from jaxlm.serve.protocol import APIError, quote

PARSERS = ("hermes", "llama3_json", "mistral", "json")
# The most tools one request may list; OpenAI allows 128.
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FALLBACK = (
    "You can call these functions, given as JSON with their parameters' JSON schema:\n"
    "{functions}\n"
    "To call functions, answer with only this JSON and nothing else: "
    '{{"tool_calls": [{{"name": "<function name>", "arguments": {{<arguments>}}}}]}}. '
    "Otherwise answer as usual."
)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclasses.dataclass
class Tools:
    """A request's functions (OpenAI's `function` objects), `choice` (`auto`, `required` or a
    function's name) and whether several calls may come at once."""

    functions: list[dict]
    choice: str
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def grammar(self) -> Grammar | None:
        """The grammar of a forced call: the JSON envelope whose calls fit the functions."""
        if not self.forced:
            return None
        named = [f for f in self.functions if self.choice in ("required", f["name"])]
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(f) for f in named]},
        }
        if not self.parallel or self.choice != "required":
            calls["maxItems"] = 1
        schema = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        return Grammar.json(schema, field="tools")


def _call_schema(function: dict) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_tools(body: dict) -> Tools | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without
    tools or with `tool_choice: "none"`."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "`parallel_tool_calls` must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "`tool_choice` needs `tools`")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"`tools` must be a list of at most {MAX_TOOLS} tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _bad("tools", "`tools` names a function twice")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise _bad("tool_choice", "`tool_choice` must name a function as OpenAI does")
        if fn.get("name") not in names:
            raise _bad("tool_choice", f"`tool_choice` names no tool: {quote(fn.get('name'))}")
        choice = fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", "`tool_choice` must be `none`, `auto`, `required` or a function")
    if choice == "none":
        return None
    return Tools(functions, choice, True if parallel is None else parallel)


def _function(tool, i: int) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(param, f'`{param}` must be an object with `type: "function"`')
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(param, f"`{param}.function` must be an object with a string `name`")
    if not _NAME.fullmatch(fn["name"]):
        raise _bad(param, f"`{param}.function.name` must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(param, f"`{param}.function.description` must be a string")
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _bad(param, f"`{param}.function.parameters` must be a JSON schema object")
        try:
            Grammar.json(parameters, field=f"{param}.function.parameters").check()
        except GrammarError as e:
            raise _bad(param, str(e)) from None
    out = {"name": fn["name"], "parameters": parameters or {"type": "object", "properties": {}}}
    if description is not None:
        out["description"] = description
    return out


# Rendering.


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself."""
    return template is not None and "tools" in template


def parser_of(template: str | None) -> str:
    """The tool-call format a chat template teaches its model, or the fallback's `json`."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "json"


def render(tokenizer, messages: list[dict], tools: Tools | None) -> str:
    """The prompt of `messages` (with their `tool_calls` and `tool` results) and the tools."""
    template = tokenizer.chat_template
    if supports_tools(template):
        specs = [{"type": "function", "function": f} for f in tools.functions] if tools else None
        history = [_for_template(m) for m in messages]
        return tokenizer.apply_chat_template(history, add_generation_prompt=True, tools=specs)
    history = [_fallback(m) for m in messages]
    if tools is not None:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
        text = FALLBACK.format(functions=listing)
        if history and history[0]["role"] == "system":
            history[0] = {"role": "system", "content": history[0]["content"] + "\n\n" + text}
        else:
            history.insert(0, {"role": "system", "content": text})
    return tokenizer.apply_chat_template(history, add_generation_prompt=True)


def _for_template(message: dict) -> dict:
    # Templates read a call's arguments as an object (they write them with `tojson`).
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = {**call["function"], "arguments": _loads(call["function"]["arguments"])}
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


def _fallback(message: dict) -> dict:
    if message["role"] == "tool":
        name = message.get("name") or message.get("tool_call_id") or "a function"
        return {"role": "user", "content": f"The result of {name}: {message['content']}"}
    if message.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])}
            for c in message["tool_calls"]
        ]
        return {"role": "assistant", "content": json.dumps({"tool_calls": calls})}
    return {"role": message["role"], "content": message["content"]}


def _loads(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


# Parsing.


def parse_calls(text: str, parser: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """The content and the tool calls of a model's output, as OpenAI's message gives them:
    calls of functions the request did not list, or whose arguments are not an object, leave
    the text as content."""
    content, calls = _PARSE[parser](text)
    names = {f["name"] for f in tools.functions}
    if not calls or not all(
        isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict)
        for c in calls
    ):
        return text, []
    if not tools.parallel:
        calls = calls[:1]
    out = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c["name"],
                "arguments": json.dumps(c["arguments"], ensure_ascii=False),
            },
        }
        for c in calls
    ]
    return (content.strip() or None) if content else None, out


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _normal(call):
    # Llama 3.x names the arguments `parameters`.
    if isinstance(call, dict) and "arguments" not in call and "parameters" in call:
        call = {"name": call.get("name"), "arguments": call["parameters"]}
    return call


def _parse_json(text: str):
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    value = _json(fenced[1] if fenced else body)
    if isinstance(value, dict) and "tool_calls" in value:
        value = value["tool_calls"]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return text, []
    return "", [_normal(c) for c in value]


def _parse_hermes(text: str):
    found = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S)
    if not found:
        return text, []
    calls = [_normal(_json(f)) for f in found]
    return text[: text.index("<tool_call>")], calls


def _parse_llama3(text: str):
    # One call, or several separated by `;`.
    body = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            call, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        calls.append(_normal(call))
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return "", calls


def _parse_mistral(text: str):
    if "[TOOL_CALLS]" not in text:
        return text, []
    head, _, tail = text.partition("[TOOL_CALLS]")
    value = _json(tail.strip())
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return text, []
    return head, [_normal(c) for c in value]


_PARSE = {
    "hermes": _parse_hermes,
    "llama3_json": _parse_llama3,
    "mistral": _parse_mistral,
    "json": _parse_json,
}


def message(text: str, tools: Tools, parser: str) -> tuple[dict, bool]:
    """The assistant message of a chat choice's text, and whether it holds tool calls (its
    `finish_reason` is `tool_calls` then). A forced call is the JSON envelope, whatever
    `parser`."""
    content, calls = parse_calls(text, "json" if tools.forced else parser, tools)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": calls}, True
