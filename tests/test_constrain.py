"""The step's penalties, `logit_bias` and grammar masks against NumPy and `llguidance`'s own
reference on hand-made logits; tool calls rendered and parsed in each family's format."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import llguidance.numpy as lln
import numpy as np
import pytest
import tokenizers

import jaxlm
from jaxlm import sampling
from jaxlm.batching import sampled
from jaxlm.requests import MAX_LOGIT_BIAS
from jaxlm.serve import tools
from jaxlm.tokenizer import Tokenizer

ROWS, VOCAB = 3, 70


def hand_made(rng):
    """Logits, counts, penalties, a sparse bias and a bitmask of `ROWS` rows."""
    logits = rng.normal(size=(ROWS, VOCAB)).astype(np.float32) * 3
    counts = rng.integers(0, 4, size=(ROWS, VOCAB)).astype(np.int32) * (
        rng.random((ROWS, VOCAB)) < 0.3
    )
    presence = np.array([0.0, 0.7, -1.5], np.float32)
    frequency = np.array([1.2, 0.0, 0.4], np.float32)
    bias_ids = np.full((ROWS, MAX_LOGIT_BIAS), VOCAB, np.int32)
    bias = np.zeros((ROWS, MAX_LOGIT_BIAS), np.float32)
    for r in range(ROWS):
        ids = rng.choice(VOCAB, 5, replace=False)
        bias_ids[r, :5], bias[r, :5] = ids, rng.uniform(-100, 100, 5)
    allowed = rng.random((ROWS, VOCAB)) < 0.4
    allowed[:, 0] = True
    # Token i is bit i % 32 of word i // 32.
    bits = np.pad(allowed, ((0, 0), (0, -VOCAB % 32))).reshape(ROWS, -1, 32).astype(np.uint64)
    mask = (bits << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32).view(np.int32)
    return logits, counts, presence, frequency, bias_ids, bias, allowed, mask


def reference(logits, counts, presence, frequency, bias_ids, bias, allowed):
    """OpenAI's definitions in NumPy: `logit - frequency * count - presence * (count > 0)`, the
    bias added, and the tokens a grammar leaves out at `-inf`."""
    out = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    for r in range(ROWS):
        for token, value in zip(bias_ids[r], bias[r], strict=True):
            if token < VOCAB:
                out[r, token] += value
    return np.where(allowed, out, -np.inf).astype(np.float32)


def step_inputs(counts, presence, frequency, bias_ids, bias, mask, temperature):
    rows = lambda v, dtype=np.float32: np.full((ROWS,), v, dtype)
    return dict(
        params=dict(
            temperature=rows(temperature),
            top_k=rows(0, np.int32),
            top_p=rows(1.0),
            min_p=rows(0.0),
            repetition_penalty=rows(1.0),
        ),
        keys=np.arange(ROWS * 2, dtype=np.uint32).reshape(ROWS, 2),
        penalties=dict(presence=presence, frequency=frequency),
        counts=counts,
        bias_ids=bias_ids,
        bias=bias,
        masked=np.bool_(True),
        mask=mask,
        logprobs=np.bool_(False),
    )


def test_the_steps_penalties_bias_and_mask_equal_numpy():
    rng = np.random.default_rng(0)
    logits, counts, presence, frequency, bias_ids, bias, allowed, mask = hand_made(rng)
    expected = reference(logits, counts, presence, frequency, bias_ids, bias, allowed)
    logits = jnp.asarray(logits)
    got = sampling.apply_bitmask(
        sampling.add_bias(
            sampling.penalize_counts(logits, counts, presence, frequency), bias_ids, bias
        ),
        mask,
    )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-5)
    # The mask as `llguidance` applies its own.
    theirs = np.array(logits)
    lln.apply_token_bitmask_inplace(theirs, mask)
    np.testing.assert_array_equal(np.asarray(sampling.apply_bitmask(logits, mask)), theirs)

    sample = jax.jit(
        lambda logits, x: sampled.sample(
            logits, x, 0 * counts[:, 0], lambda: x["counts"] > 0, lambda: x["counts"]
        )[0]
    )
    x = step_inputs(counts, presence, frequency, bias_ids, bias, mask, 0.0)
    np.testing.assert_array_equal(np.asarray(sample(logits, x)), expected.argmax(-1))
    # New values, a sampled batch, no mask: nothing compiles, and no row draws a masked token.
    with jaxlm.CompileCounter() as compiles:
        for seed in range(1, 6):
            logits, counts, presence, frequency, bias_ids, bias, allowed, mask = hand_made(
                np.random.default_rng(seed)
            )
            x = step_inputs(counts, presence, frequency, bias_ids, bias, mask, 1.0)
            x["keys"] += seed
            token = np.asarray(sample(logits, x))
            assert allowed[np.arange(ROWS), token].all()
            x = step_inputs(counts, presence * 0, frequency * 0, bias_ids, bias * 0, mask, 0.0)
            x["masked"] = np.bool_(False)
            np.testing.assert_array_equal(np.asarray(sample(logits, x)), logits.argmax(-1))
    assert compiles.builds == 0


FN = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
CALLS = tools.Tools([FN], "auto", True)
ONE, TWO = '{"name": "f", "arguments": {"x": 1}}', '{"name": "f", "arguments": {"x": 2}}'
LLAMA_ONE, LLAMA_TWO = (c.replace("arguments", "parameters") for c in (ONE, TWO))


@pytest.mark.parametrize(
    "parser, text, content",
    [
        ("hermes", f"Sure.\n<tool_call>\n{ONE}\n</tool_call>", "Sure."),
        ("hermes", f"<tool_call>{ONE}</tool_call>\n<tool_call>{TWO}", None),
        ("llama3_json", f"<|python_tag|>{LLAMA_ONE}; {LLAMA_TWO}", None),
        ("llama3_json", LLAMA_ONE, None),
        ("mistral", f"ok [TOOL_CALLS] [{ONE}]", "ok"),
        ("json", f'```json\n{{"tool_calls": [{ONE}]}}\n```', None),
        ("json", f"[{ONE}, {TWO}]", None),
    ],
)
def test_each_familys_tool_calls_parse(parser, text, content):
    got, calls = tools.parse_calls(text, parser, CALLS)
    assert got == content
    args = [json.loads(c["function"]["arguments"]) for c in calls]
    assert args in ([{"x": 1}], [{"x": 1}, {"x": 2}]) and args[0] == {"x": 1}
    assert len(args) == text.count('"name"')
    assert all(c["function"]["name"] == "f" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize(
    "text",
    ["The answer is 4.", '{"name": "g", "arguments": {}}', '{"name": "f", "arguments": "x=1"}',
     "<tool_call>not json</tool_call>"],
)  # fmt: skip
def test_text_that_is_no_call_of_a_listed_function_stays_content(text):
    for parser in tools.PARSERS:
        assert tools.parse_calls(text, parser, CALLS) == (text, [])


def test_templates_pick_their_parser_and_render_tools():
    assert tools.parser_of("{{ '<tool_call>' }}") == "hermes"
    assert tools.parser_of("[TOOL_CALLS]") == "mistral"
    assert tools.parser_of("<|python_tag|>") == "llama3_json"
    assert tools.parser_of(None) == "json"
    # Rendering reads no vocabulary: any backend will do.
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.arguments.x }}>{% endfor %};{% endfor %}"
    )
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 7}'}}
        ]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]  # fmt: skip
    native = tools.render(Tokenizer(backend, chat_template=template), history, CALLS)
    assert native == "[f]user:hi;assistant:<7>;tool:42;"
    chatml = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    fallback = tools.render(Tokenizer(backend, chat_template=chatml), history, CALLS)
    system, user, call, result, _ = fallback.split(";")
    assert user == "user:hi"
    assert system.startswith("system:") and json.dumps(FN) in system
    assert call == 'assistant:{"tool_calls": [{"name": "f", "arguments": {"x": 7}}]}'
    assert result == "user:The result of f: 42"
