"""`jaxlm serve` through the real `openai` client and raw HTTP: its answers equal `generate`'s,
its errors are OpenAI's, and nothing a client does leaks a page or stops the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import CHATS, SMOLLM2_LLAMACPP
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import free_port, wait_until_healthy

import jaxlm

MODEL = "smollm2"


@pytest.fixture(scope="module")
def served(served_default):
    return served_default


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0)


def pages_in_use(engine, timeout=60.0) -> int:
    """The engine's pages in use once it has nothing left to run (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.running == s.waiting == 0:
            return s.pages_in_use
        time.sleep(0.02)
    return engine.stats().pages_in_use


PROMPT = "The three primary colours are"
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]


def test_completion_equals_generate(smollm2, client):
    model, tokenizer = smollm2
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    (expected,) = jaxlm.generate(model, tokenizer, PROMPT, max_new_tokens=24)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.token_ids) == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24
    assert out.object == "text_completion" and out.model == MODEL and out.id


def test_chat_completion_equals_chat(smollm2, client):
    model, tokenizer = smollm2
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=40, temperature=0
    )
    assert out.choices[0].message.content == jaxlm.chat(
        model, tokenizer, MESSAGES, max_new_tokens=40
    )
    assert out.choices[0].message.role == "assistant"
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True),
        add_special_tokens=False,
    )
    (expected,) = jaxlm.generate(model, tokenizer, prompt, max_new_tokens=40)
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].finish_reason == expected.finish_reason
    # An empty list of stop strings is no stop strings, as OpenAI takes it.
    again = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=40, temperature=0, stop=[]
    )
    assert again.choices[0].message.content == expected.text


def test_streams_equal_the_whole_answers_and_end_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0
    )
    pieces = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stream=True
        )
    )
    assert pieces[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in pieces)
    assert text == chat.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_sixteen_concurrent_streams_get_their_solo_tokens(smollm2, served, client):
    model, tokenizer = smollm2
    prompts = [f"Write a sentence about the number {i}." * (1 + i % 3) for i in range(16)]
    expected = [jaxlm.generate(model, tokenizer, p, max_new_tokens=16)[0].text for p in prompts]
    got = [None] * 16

    def run(i):
        stream = client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stream=True
        )
        got[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
    assert pages_in_use(served[1]) == 0


def test_eight_requests_answer_the_same_with_drafts_as_without(smollm2, served):
    # The served engine drafts (`speculative="ngram"`): eight chats at once, half of which
    # repeat their prompt, and the reference prompts, each to its end, drafted or not.
    _, tokenizer = smollm2
    engine = served[1]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    prompts = [tokenizer.encode(c, add_special_tokens=False) for c in chats]
    prompts += [c["prompt_ids"] for c in SMOLLM2_LLAMACPP["generations"]]
    assert len(prompts) >= 8
    before = engine.stats()

    def answers(**kwargs):
        handles = [engine.submit(p, max_new_tokens=48, **kwargs) for p in prompts]
        return [h.result(timeout=300) for h in handles]

    plain, drafted = answers(speculative=None), answers()
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert [r.finish_reason for r in drafted] == [r.finish_reason for r in plain]
    after = engine.stats()
    assert after.drafted_tokens - before.drafted_tokens > 0
    assert after.accepted_tokens - before.accepted_tokens > 0
    # Each result counts its own drafts: those that drafted kept some; the others drafted none.
    assert sum(r.accepted_tokens for r in drafted) > 0
    assert all(r.drafted_tokens >= r.accepted_tokens for r in drafted)
    assert all(r.drafted_tokens == r.accepted_tokens == 0 for r in plain)
    assert pages_in_use(engine) == 0


def test_logprobs_of_greedy_tokens_are_the_top_ones(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        probs = [a.logprob for a in t.top_logprobs]
        assert probs == sorted(probs, reverse=True)
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == 5
    assert [max(d.values()) for d in lp.top_logprobs] == pytest.approx(lp.token_logprobs)


def test_seeded_choices_reproduce_and_differ(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt counts once


def test_models_health_and_unknown_model(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served[0].url + "/health").status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
HOSTILE = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b""),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'"a string"'),
    ("/v1/completions", b"\xff\xfe"),
    ("/v1/chat/completions", b"{"),
    *[
        ("/v1/completions", {**GOOD, **change})
        for change in [
            {"prompt": None},
            {"ignore_eos": "yes"},
            {"prompt": ""},
            {"prompt": []},
            {"prompt": 5},
            {"prompt": [[]]},
            {"prompt": [1.5, 2]},
            {"prompt": [10**12]},
            {"prompt": [-1]},
            {"prompt": {"text": "hi"}},
            {"max_tokens": -1},
            {"max_tokens": 0},
            {"max_tokens": 10**9},
            {"max_tokens": 2.5},
            {"max_tokens": "8"},
            {"max_tokens": True},
            {"temperature": -1},
            {"temperature": "hot"},
            {"temperature": 1e400},
            {"top_p": 0},
            {"top_p": 1.5},
            {"top_k": -5},
            {"min_p": 2},
            {"repetition_penalty": 0},
            {"n": 0},
            {"n": 1000},
            {"stop": 3},
            {"stop": [""]},
            {"stop": ["a"] * 100},
            {"seed": "x"},
            {"seed": 2**80},
            {"stream": "yes"},
            {"stream_options": {"include_usage": True}},
            {"logprobs": 99},
            {"echo": True},
            {"presence_penalty": 2.5},
            {"logit_bias": {"x": 5}},
            {"model": 7},
            {"model": "other"},
            {"prompt": "word " * 100_000},
        ]
    ],
    *[
        ("/v1/chat/completions", {**CHAT, **change})
        for change in [
            {"messages": []},
            {"messages": None},
            {"messages": "hello"},
            {"messages": [{"content": "no role"}]},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"messages": [{"role": "user", "content": 5}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            {"messages": ["hi"]},
            {"top_logprobs": 3},
            {"logprobs": True, "top_logprobs": 50},
            {"max_completion_tokens": -3},
            {"tools": [{"type": "function"}]},
            {"response_format": {"type": "json_schema"}},
            {"messages": [{"role": "user", "content": "long " * 100_000}]},
        ]
    ],
]


def test_hostile_requests_get_openai_errors_and_leak_nothing(served):
    running, engine = served
    assert len(HOSTILE) >= 50
    with httpx.Client(base_url=running.url, timeout=120) as http:
        for path, body in HOSTILE:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body if len(content) < 200 else "...")
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        huge = http.post("/v1/completions", content=b"x" * (9 * 2**20))
        assert huge.status_code == 413 and huge.json()["error"]["message"]
        assert http.get("/v1/nowhere").status_code == 404
        assert http.get("/v1/completions").status_code == 405
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=GOOD).status_code == 200
    assert pages_in_use(engine) == 0


def test_clients_that_leave_mid_stream_free_their_pages(smollm2, served, client):
    running, engine = served
    body = {**GOOD, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=running.url, timeout=120) as http:
        for i in range(8):
            prompt = f"Count slowly from {i} to a thousand:"
            with http.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
                events = []
                for line in r.iter_lines():
                    events += [line] if line.startswith("data:") else []
                    if len(events) == 3:
                        break
            assert len(events) == 3
    assert pages_in_use(engine) == 0
    model, tokenizer = smollm2
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert (
        out.choices[0].text == jaxlm.generate(model, tokenizer, PROMPT, max_new_tokens=10)[0].text
    )


def metric(text: str, name: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def test_metrics_parse_and_move(served, client):
    url = served[0].url + "/metrics"
    before = httpx.get(url).text
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    after = httpx.get(url).text
    assert (
        metric(after, "jaxlm_generation_tokens_total")
        - metric(before, "jaxlm_generation_tokens_total")
        == 6
    )
    for name in ("jaxlm_time_to_first_token_seconds_count", "jaxlm_engine_steps_total"):
        assert metric(after, name) > metric(before, name)
    assert (
        metric(after, "jaxlm_inter_token_latency_seconds_count")
        - metric(before, "jaxlm_inter_token_latency_seconds_count")
        == 5
    )
    assert metric(after, "jaxlm_requests_total") == metric(before, "jaxlm_requests_total") + 1
    assert metric(after, "jaxlm_kv_pages_free") > 0
    drafted, accepted = (
        metric(after, f"jaxlm_spec_decode_num_{n}_tokens_total") for n in ("draft", "accepted")
    )
    stats = served[1].stats()
    assert (drafted, accepted) == (stats.drafted_tokens, stats.accepted_tokens)
    for name in ("jaxlm_requests_running", "jaxlm_requests_waiting", "jaxlm_kv_pages_in_use"):
        assert metric(after, name) == 0


def test_a_full_queue_answers_429_and_keeps_serving(served):
    running, engine = served
    with httpx.Client(base_url=running.url, timeout=60) as http:
        queue = engine.scheduler.max_queue
        engine.scheduler.max_queue = 0  # as if the queue were full
        try:
            r = http.post("/v1/completions", json=GOOD)
        finally:
            engine.scheduler.max_queue = queue
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert http.post("/v1/completions", json=GOOD).status_code == 200
    assert pages_in_use(engine) == 0


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signals_stop_the_server_cleanly(tiny_chat, sig, code):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "jaxlm", "serve", "--model", str(tiny_chat)]
    command += ["--port", str(port), "--max-num-seqs", "2", "--max-seq-len", "256"]
    command += ["--max-num-batched-tokens", "32"]
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, timeout=240)
        body = {"prompt": "Hello", "max_tokens": 240, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(sig)
            for _ in lines:  # the stream ends: finished, or cut after the graceful period
                pass
        assert proc.wait(timeout=60) == code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port is free again
    log = proc.stderr.read()
    assert "serving at" in log and "k_pages" in log and "Traceback" not in log
