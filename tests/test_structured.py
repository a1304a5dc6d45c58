"""Structured outputs through `jaxlm serve` and the real `openai` client: `response_format`
(Pydantic models), vLLM's `structured_outputs` (regular expressions, choices), tool calls
forced by a grammar, and hostile constraints; every output checked against its schema with
`jsonschema`, on the default model."""

from __future__ import annotations

import concurrent.futures
import enum
import json
import re
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serve_helpers import assert_openai_error, idle

import jaxlm
from jaxlm import constrain

MODEL = "smollm2"


@pytest.fixture(scope="module")
def served(served_default):
    return served_default


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=120) as c:
        yield c


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# Five schemas: nested objects, arrays, enums, bounded numbers, optional fields. Strings are
# bounded so that a small model cannot run past `max_tokens` inside one.
class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


class Person(BaseModel):
    name: str = Field(max_length=16)
    address: Address


class Groceries(BaseModel):
    items: list[str] = Field(min_length=1, max_length=3)
    counts: list[int] = Field(max_length=3)


class Finish(enum.Enum):
    matte = "matte"
    gloss = "gloss"


class Paint(BaseModel):
    colour: Literal["red", "green", "blue"]
    finish: Finish


class Reading(BaseModel):
    celsius: float = Field(ge=-40, le=50)
    sensors: int = Field(ge=1, le=9)


class Profile(BaseModel):
    nickname: str | None = Field(default=None, max_length=12)
    age: int | None = Field(default=None, ge=0, le=120)


SCHEMAS = [
    (Person, "Describe a person who lives in Paris, as JSON."),
    (Groceries, "List some groceries as JSON."),
    (Paint, "Pick a paint as JSON."),
    (Reading, "Give a weather sensor reading as JSON."),
    (Profile, "Give a user profile as JSON."),
]


def _schema(model) -> dict:
    return openai.lib._pydantic.to_strict_json_schema(model)


def test_parse_returns_objects_that_fit_their_schemas(client):
    def parse(model, prompt, stream):
        kw = dict(model=MODEL, messages=ask(prompt), response_format=model, temperature=0)
        if not stream:
            out = client.chat.completions.parse(max_completion_tokens=96, **kw)
            return out.choices[0]
        with client.chat.completions.stream(max_completion_tokens=96, **kw) as s:
            return s.get_final_completion().choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS) * 2) as pool:
        futures = [pool.submit(parse, m, p, stream) for m, p in SCHEMAS for stream in (False, True)]
        outs = [f.result() for f in futures]
    for (model, _), plain, streamed in zip(SCHEMAS, outs[::2], outs[1::2], strict=True):
        for choice in (plain, streamed):
            assert choice.finish_reason == "stop", choice
            assert isinstance(choice.message.parsed, model)
            jsonschema.validate(json.loads(choice.message.content), _schema(model))
        # Greedy: the stream gives the same object.
        assert streamed.message.content == plain.message.content


def test_generate_stream_and_chat_hold_to_a_schema_as_the_engine_does(served):
    engine = served[1]
    model, tokenizer = engine.model, engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template(ask(p), add_generation_prompt=True) for _, p in SCHEMAS[:2]
    ]
    formats = [{"type": "json_schema", "json_schema": {"schema": _schema(m)}} for m, _ in SCHEMAS]
    # Every call below runs on one plan of two rows: the masked steps compile once.
    plan = jaxlm.plan(
        model,
        max_batch=2,
        max_seq_len=512,
        prefill_chunk=128,
        steps=("start_masked", "decode_masked"),
    )
    kw = dict(max_new_tokens=96, response_format=formats[0])
    # Two rows under one grammar in one call: `Person` for both prompts.
    out = jaxlm.generate(model, tokenizer, prompts, plan=plan, **kw)
    for i, prompt in enumerate(prompts):
        assert out[i].finish_reason == "stop", out
        jsonschema.validate(json.loads(out[i].text), _schema(Person))
        # Greedy under the same grammar: the engine's tokens, and `stream`'s text.
        assert engine.submit(prompt, **kw).result().token_ids == out[i].token_ids
        deltas = list(jaxlm.stream(model, tokenizer, prompt, plan=plan, **kw))
        assert "".join(d.text for d in deltas) == out[i].text
        assert [t for d in deltas for t in d.token_ids] == out[i].token_ids
        assert deltas[-1].finish_reason == out[i].finish_reason
    reply = jaxlm.chat(model, tokenizer, ask(SCHEMAS[2][1]), response_format=Paint, plan=plan)
    assert Paint.model_validate_json(reply)
    # Cut short, the output is the start of an object and ends for its `length`.
    short = jaxlm.generate(
        model, tokenizer, prompts[0], max_new_tokens=3, response_format=Paint, plan=plan
    )
    assert [o.finish_reason for o in short] == ["length"] and short[0].text.startswith("{")
    assert len(short[0].token_ids) == 3
    # `generate` and the engine compiled their grammars with one `llguidance` tokenizer.
    assert engine._grammars is constrain.grammars_for(tokenizer, model.config.vocab_size)


def test_regex_and_choice_are_met_exactly_with_sampling(client):
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    options = ["north", "south", "east by east", "west"]

    def create(i, extra):
        return client.chat.completions.create(
            model=MODEL,
            messages=ask("Name a place."),
            temperature=1.0,
            seed=i,
            max_completion_tokens=24,
            extra_body={"structured_outputs": extra},
        ).choices[0]

    def endless():
        # A pattern longer than `max_tokens`: that ends it.
        return client.chat.completions.create(
            model=MODEL,
            messages=ask("Digits:"),
            max_completion_tokens=6,
            extra_body={"structured_outputs": {"regex": "[0-9]{40}"}},
        ).choices[0]

    def complete(i):
        # The text completions' endpoint, with OpenAI's `response_format`.
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": options}}}
        return client.completions.create(
            model=MODEL,
            prompt="A direction:",
            temperature=1.0,
            seed=i,
            max_tokens=24,
            extra_body={"response_format": fmt},
        ).choices[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        regex = [pool.submit(create, i, {"regex": pattern}) for i in range(4)]
        choice = [pool.submit(create, i, {"choice": options}) for i in range(2)]
        texts = [pool.submit(complete, i) for i in range(2)]
        long = pool.submit(endless)
        regex, choice = [f.result() for f in regex], [f.result() for f in choice]
        texts, long = [f.result() for f in texts], long.result()
    assert long.message.content.isdigit() and long.finish_reason == "length"
    assert len(long.message.content) < 40
    for c in texts:
        assert json.loads(c.text) in options and c.finish_reason == "stop", c
    for c in regex:
        assert re.fullmatch(pattern, c.message.content) and c.finish_reason == "stop", c
    for c in choice:
        assert c.message.content in options and c.finish_reason == "stop", c
    # Sampling on: the seeds do not all give one answer.
    assert len({c.message.content for c in regex}) > 1


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_forced_tool_calls_fit_their_schemas_streamed_or_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}

    def call(choice, stream):
        kw = dict(
            model=MODEL,
            messages=ask("What is the weather in Oslo?"),
            tools=TOOLS,
            tool_choice=choice,
            temperature=0,
            max_completion_tokens=64,
        )
        if not stream:
            return client.chat.completions.create(**kw).choices[0]
        with client.chat.completions.stream(**kw) as s:
            return s.get_final_completion().choices[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(call, c, st) for c in ("required", named) for st in (False, True)]
        required, required_streamed, named_out, named_streamed = (f.result() for f in futures)
    assert [c.function.name for c in named_out.message.tool_calls] == ["get_time"]
    for out, streamed in ((required, required_streamed), (named_out, named_streamed)):
        assert out.finish_reason == streamed.finish_reason == "tool_calls"
        _check_calls(out.message.tool_calls)
        pairs = zip(streamed.message.tool_calls, out.message.tool_calls, strict=True)
        for a, b in pairs:
            assert (a.function.name, json.loads(a.function.arguments)) == (
                b.function.name,
                json.loads(b.function.arguments),
            )


def test_a_tool_result_renders_and_is_answered(client, http):
    messages = ask("What is the weather in Oslo?")
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_completion_tokens=64,
    ).choices[0]
    (call,) = first.message.tool_calls
    history = [
        *messages,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_completion_tokens=24
    ).choices[0]
    assert second.message.content and second.finish_reason in ("stop", "length")
    # The fallback prompt lists the tool, writes the call and hands over its result.
    ids = http.post("/tokenize", json={"messages": history, "tools": [WEATHER]}).json()
    prompt = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in prompt and '{"temperature": 21}' in prompt
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 1024


def test_unconstrained_requests_beside_constrained_ones_keep_their_tokens(client, served):
    _, engine = served
    prompts = [f"Count from {i} to {i + 5}:" for i in range(4)]

    def plain(p):
        out = client.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0, logprobs=0
        )
        return out.choices[0].logprobs.tokens

    # The two shortest objects, twice each.
    short = [SCHEMAS[2], SCHEMAS[3]] * 2

    def constrained(i):
        return client.chat.completions.parse(
            model=MODEL,
            messages=ask(short[i][1]),
            response_format=short[i][0],
            temperature=0,
            max_completion_tokens=96,
        ).choices[0]

    solo = [plain(p) for p in prompts]
    with jaxlm.CompileCounter() as compiles, concurrent.futures.ThreadPoolExecutor(8) as pool:
        both = [pool.submit(plain, p) for p in prompts]
        both += [pool.submit(constrained, i) for i in range(4)]
        outs = [f.result() for f in both]
    assert outs[:4] == solo
    for (model, _), out in zip(short, outs[4:], strict=True):
        assert isinstance(out.message.parsed, model)
    stats = idle(engine)
    assert stats.pages_in_use == 0 and stats.grammar_masks > 0
    assert compiles.builds == 0


def test_penalties_and_logit_bias_change_tokens_without_compiling(client, http):
    def tokens(**kw):
        out = client.completions.create(
            model=MODEL,
            prompt="hello hello hello hello hello hello",
            max_tokens=8,
            temperature=0,
            logprobs=0,
            **kw,
        )
        return out.choices[0].logprobs.tokens

    def token_id(text):
        (token,) = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        return str(token)

    plain = tokens()
    with jaxlm.CompileCounter() as compiles:
        biased = tokens(logit_bias={token_id(" a"): 100})
        banned = tokens(logit_bias={token_id(plain[0]): -100})
        penalized = tokens(frequency_penalty=2.0, presence_penalty=2.0)
    assert compiles.builds == 0
    assert biased == [" a"] * 8
    assert banned[0] != plain[0] and plain[0] not in banned
    # Greedy, the model repeats the word; penalized, it moves on.
    assert plain.count(" hello") > 2 and penalized.count(" hello") < plain.count(" hello")


HUGE = "start: " + " | ".join(f'"w{i}"' for i in range(20_000))


def schema_format(schema) -> dict:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def tool(parameters) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}


HOSTILE = {
    "unknown type": (schema_format({"type": "frob"}), "response_format"),
    "dangling $ref": (schema_format({"$ref": "#/nowhere"}), "response_format"),
    "unknown format": ({"response_format": {"type": "xml"}}, "response_format"),
    "regex without a match": ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),
    "look-behind": ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),
    "grammar too large": ({"structured_outputs": {"grammar": HUGE}}, "structured_outputs"),
    "no choices": ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    "tool schema of unknown type": (tool({"type": "frob"}), "tools[0]"),
    "tool schema not an object": (tool([]), "tools[0]"),
    "tool_choice names no tool": (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    "logit_bias beyond the vocabulary": ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    "presence_penalty beyond 2": ({"presence_penalty": 3}, "presence_penalty"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_constraints_are_refused_and_the_server_goes_on(http, name):
    extra, param = HOSTILE[name]
    body = {"model": MODEL, "messages": ask("hi"), "max_tokens": 4, **extra}
    start = time.monotonic()
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param and time.monotonic() - start < 10
    ok = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ask("hi"), "max_tokens": 2}
    )
    assert ok.status_code == 200
