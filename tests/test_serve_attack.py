"""`jaxlm serve` as an attacker tries it, on 127.0.0.1: hostile bodies answer 4xx in OpenAI's
shape, a client that leaves stops its request at once, slow clients are cut off, a shutdown
ends every response in its own shape, and no request holds every slot while another waits."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import rewrite_config
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import (
    HOSTILE,
    MODEL,
    Records,
    Running,
    assert_openai_error,
    free_port,
    generated,
    idle,
    wait_until_healthy,
)

import jaxlm
from jaxlm.batching import PagePool, Scheduler
from jaxlm.batching.handle import RequestHandle
from jaxlm.outputs import Detokenizer, find_stop
from jaxlm.serve import create_app, http
from jaxlm.serve.protocol import QUOTE_CHARS

MAX_NUM_SEQS = 8
CONTEXT = 2048
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def log():
    records = Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "jaxlm.serve")]
    for logger in loggers:
        logger.addHandler(records)
    yield records
    for logger in loggers:
        logger.removeHandler(records)


@pytest.fixture(scope="module")
def long_chat(tiny_chat, tmp_path_factory):
    """The tiny chat model with a context long enough for requests that run for seconds: the
    default model would cost a minute of compiling for what these tests need of it."""
    path = tmp_path_factory.mktemp("long_chat")
    shutil.copytree(tiny_chat, path, dirs_exist_ok=True)
    rewrite_config(path, max_position_embeddings=CONTEXT)
    return path


@pytest.fixture(scope="module")
def served(long_chat, log):
    model, tokenizer = jaxlm.load(long_chat)
    engine = jaxlm.LLMEngine(
        model,
        tokenizer,
        max_num_seqs=MAX_NUM_SEQS,
        page_size=16,
        num_pages=MAX_NUM_SEQS * CONTEXT // 16 + 1,
        max_num_batched_tokens=16,
    )
    running = Running(create_app(engine, MODEL, body_timeout=BODY_TIMEOUT_S))
    yield running, engine
    running.stop()
    engine.close()
    # Nothing the attacks did wrote a traceback to the log.
    assert "Traceback" not in log.text()
    assert not [r for r in log.records if r.exc_info]


@pytest.fixture(scope="module")
def http_client(served):
    with httpx.Client(base_url=served[0].url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_hostile_bodies_get_openai_errors(served, http_client, case):
    path, body, status, *param = HOSTILE[case]
    param = param[0] if param else case.split()[0]
    r = http_client.post(path, content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(r, status)
    assert error["param"] == param
    # The message quotes at most a bounded part of what was sent.
    assert len(error["message"]) < QUOTE_CHARS + 200
    assert http_client.get("/health").status_code == 200


# Any JSON value, surrogates and numbers beyond a float included, for any field.
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["\ud800", "a\udfff", "", "-1"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
FIELDS = [
    "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "repetition_penalty", "n", "stop", "seed", "stream",
    "stream_options", "logprobs", "top_logprobs", "ignore_eos", "echo", "presence_penalty",
    "logit_bias", "response_format", "tool_choice", "user",
]  # fmt: skip
BODIES = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    st.dictionaries(st.sampled_from(FIELDS), VALUES | st.just(MODEL)),
    st.sampled_from([[{"role": "user", "content": "Hi"}], "Hi", [1, 2, 3]]),
)


@settings(max_examples=100, deadline=None)
@given(BODIES)
def test_any_body_answers_200_or_a_4xx_in_openai_shape(served, http_client, case):
    path, body, prompt = case
    body.setdefault("messages" if "chat" in path else "prompt", prompt)
    for name in ("max_tokens", "max_completion_tokens"):
        # A valid length, or none, made short: the test is of the answers, not of generating.
        value = body.get(name)
        if value is None or (isinstance(value, int | float) and value > 4 and value % 1 == 0):
            body[name] = 4
    r = http_client.post(path, content=json.dumps(body).encode())
    if r.status_code != 200:
        assert_openai_error(r)
    elif body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.json()["choices"]


def test_an_unexpected_error_answers_500_without_internals(served, http_client, log, monkeypatch):
    def broken(*args):
        raise KeyError("a secret of the server")

    monkeypatch.setattr("jaxlm.serve.protocol.usage", broken)
    before = len(log.records)
    r = http_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 500
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "KeyError" not in r.text and "secret" not in r.text
    lines = [r for r in log.records[before:] if r.name == "jaxlm.serve"]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "KeyError" in lines[0].getMessage()
    monkeypatch.undo()
    assert http_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).is_success


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_that_leaves_stops_its_request_within_a_step(
    served, http_client, stream, monkeypatch
):
    running, engine = served
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    body = json.dumps(body | {"temperature": 0, "stream": stream}).encode()
    # The engine's tokens when the server heard the client leave and cancelled its request.
    heard, cancel = [], RequestHandle.cancel

    def counted_cancel(handle):
        heard.append(engine.stats().generated_tokens)
        cancel(handle)

    monkeypatch.setattr(RequestHandle, "cancel", counted_cancel)
    before = generated(http_client)
    start = engine.stats().generated_tokens
    # The client leaves once its request has tokens, not after a fixed time: on a fast machine
    # the tiny model runs all 2,000 tokens within a second.
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as leaving:
        leaving.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 60
        while engine.stats().generated_tokens == start and time.monotonic() < deadline:
            time.sleep(0.001)
    left = generated(http_client)
    s = idle(engine)
    assert s.pages_in_use == 0 and s.running == s.waiting == 0
    after = generated(http_client)
    assert 0 < left - before < 2000
    # At most one XLA call's tokens (`decode_steps` steps) after the server heard the client
    # leave (a tiny model's call can take less than the event loop needs to hear it).
    assert heard and after - heard[0] <= engine.decode_steps


def test_a_short_request_starts_within_steps_beside_n_eight(served, http_client, monkeypatch):
    running, engine = served
    scheduler, submitted, first = engine.scheduler, {}, {}
    submit, update = scheduler.submit, scheduler.update

    def counted_submit(prompt, max_new_tokens, group=None):
        seq = submit(prompt, max_new_tokens, group)
        submitted[seq.id] = engine.steps
        return seq

    def counted_update(batch, sampled, stop=None):
        finished = update(batch, sampled, stop)
        for c in batch.chunks:
            if c.seq.output:
                first.setdefault(c.seq.id, engine.steps)
        return finished

    # The engine's steps from each sequence's submission to its first token.
    monkeypatch.setattr(scheduler, "submit", counted_submit)
    monkeypatch.setattr(scheduler, "update", counted_update)
    long = {"prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True, "n": 8}
    long |= {"temperature": 0.8, "seed": 1, "stream": True}
    short = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    with (
        httpx.Client(base_url=running.url, timeout=120) as other,
        other.stream("POST", "/v1/completions", json=long) as big,
    ):
        lines = big.iter_lines()
        while engine.stats().running < MAX_NUM_SEQS:
            next(lines)
        r = http_client.post("/v1/completions", json=short)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # The long request still runs: the choice the short one preempted (every slot was
        # taken) comes back at the engine's next step, which may follow the short answer.
        deadline = time.monotonic() + 60
        while engine.stats().running < MAX_NUM_SEQS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats().running == MAX_NUM_SEQS
    short_id = max(submitted)
    # The short request's first token came within the call that ran when it arrived and the
    # next step, not after the thousands of tokens the long request had left.
    assert first[short_id] - submitted[short_id] <= engine.decode_steps + 1
    assert idle(engine).pages_in_use == 0


def test_a_body_sent_slowly_is_refused_with_408(served):
    running, _ = served
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        start = time.monotonic()
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
            if b"\r\n\r\n" in reply and reply.rstrip().endswith(b"}"):
                break
    assert reply.startswith(b"HTTP/1.1 408")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert time.monotonic() - start < BODY_TIMEOUT_S + 3


def test_slow_and_large_headers_are_cut_off(served, monkeypatch):
    running, _ = served
    monkeypatch.setattr(http, "HEADERS_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert s.recv(1024) == b""  # closed without an answer
        assert time.monotonic() - start < 3
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (17 * 2**10))
        assert s.recv(1024).startswith(b"HTTP/1.1 4")


def test_soak_of_600_requests_leaves_no_page_in_use(served):
    running, engine = served
    answered = []

    def client(i, requests):
        with httpx.Client(base_url=running.url, timeout=60) as c:
            for j in range(requests):
                body = {"prompt": f"Item {i} {j}:", "max_tokens": 1 + (i + j) % 3}
                if j % 5 == 4:
                    body |= {"stream": True, "max_tokens": 50}
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        next(r.iter_lines())  # leave mid-stream
                else:
                    answered.append(c.post("/v1/completions", json=body).status_code)

    def soak(requests):
        threads = [threading.Thread(target=client, args=(i, requests)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # The server's memory over a soak is measured apart from the client's, by
    # `benchmarks/serve_soak.py`.
    soak(75)
    s = idle(engine)
    assert s.running == s.waiting == s.pages_in_use == 0
    assert answered == [200] * 8 * 60


# The scheduler alone, without a model.


def test_a_group_of_many_choices_shares_the_slots():
    scheduler = Scheduler(PagePool(65, 4), max_num_seqs=4, max_num_batched_tokens=32)
    many = [scheduler.submit([1, 2, 3], 50, group="n=8") for _ in range(8)]
    for _ in range(8):
        batch = scheduler.schedule()
        scheduler.update(batch, {c.seq.id: 5 for c in batch.chunks if c.sample})
    assert sum(s.status.value == "running" for s in many) == 4
    other = scheduler.submit([7, 8, 9], 2, group="other")
    batch = scheduler.schedule()
    # The newest of the large group's sequences makes room at once.
    assert other in [c.seq for c in batch.chunks]
    assert [s.id for s in batch.preempted] == [many[3].id]
    scheduler.update(batch, {c.seq.id: 5 for c in batch.chunks if c.sample})
    # No more preemption while every waiting group runs something.
    assert scheduler.schedule().preempted == ()


def test_prompts_of_one_token_are_admitted_together():
    scheduler = Scheduler(
        PagePool(65, 4), max_num_seqs=8, max_num_batched_tokens=32, max_prefill_chunks=1
    )
    long = scheduler.submit(list(range(1, 20)), 1)
    seqs = [scheduler.submit([i + 1], 1) for i in range(12)]
    batch = scheduler.schedule()
    # One chunk of the long prompt, and every 1-token prompt a free slot allows.
    assert sorted(len(c.tokens) for c in batch.chunks) == [1] * 7 + [19]
    assert {c.seq.id for c in batch.chunks} == {s.id for s in seqs[:7]} | {long.id}


def test_stop_strings_are_searched_only_where_they_can_end():
    scanned, decoded = [], []

    class Text(str):
        """Text that records how many characters each search of it may read; what it is
        joined to or cut from it stays `Text`."""

        def find(self, sub, start=0, end=None):
            end = len(self) if end is None else end
            scanned.append(end - start)
            return super().find(sub, start, end)

        def __add__(self, other):
            return Text(str(self) + other)

        def __radd__(self, other):
            return Text(other + str(self))

        def __getitem__(self, key):
            return Text(super().__getitem__(key))

    class Chars:
        def decode(self, ids):
            decoded.append(len(ids))
            return Text("".join(map(chr, ids)))

    stops = tuple("q" * 1999 + c for c in "wxyz")
    detok, ids = Detokenizer(Chars(), stops), [ord("a")] * 20_000
    pieces = [detok.update(ids[:n], final=False) for n in (19_500, 19_501)]
    scanned.clear()
    decoded.clear()
    pieces += [detok.update(ids[:n], final=False) for n in range(19_502, 20_000)]
    # Each later update decoded the tokens of the update before and its own, searched a window
    # of the last `len(stop)` characters and the new one, not the whole text of 20,000, and
    # held nothing back: no end of it begins a stop string. Each stop string took one search
    # for itself and one for what could begin it.
    assert 0 < max(decoded) <= 2
    assert 0 < max(scanned) <= len(stops[0]) + 1
    assert len(scanned) <= 499 * 2 * len(stops)
    assert "".join(pieces) == "a" * 19_999

    stops = tuple("q" * 255 + c for c in "wxyz")
    detok, ids = Detokenizer(Chars(), stops), [ord("q")] * 2_000
    pieces = [detok.update(ids[:n], final=False) for n in range(1, 2_001)]
    assert "".join(pieces) == "q" * (2_000 - 255)  # what could begin a stop string waits
    text = "q" * 2_000 + "y"
    pieces.append(detok.update([*ids, ord("y")], final=False))
    assert detok.finished and "".join(pieces) == text[: find_stop(text, stops)]


def test_sigterm_ends_every_request_in_its_shape(long_chat):
    port = free_port()
    command = [sys.executable, "-m", "jaxlm", "serve", "--model", str(long_chat)]
    command += ["--port", str(port), "--max-num-seqs", str(MAX_NUM_SEQS)]
    command += ["--max-seq-len", str(CONTEXT), "--max-num-batched-tokens", "16"]
    command += ["--shutdown-grace", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, timeout=120)
        body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
        streams, plain = [None] * 4, [None] * 2

        def stream(i):
            stream = body | {"stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=stream, timeout=60) as r:
                streams[i] = [line for line in r.iter_lines() if line.startswith("data:")]

        def ask(i):
            plain[i] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while (
            sum(
                float(line.split()[1])
                for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith(("jaxlm_requests_running ", "jaxlm_requests_waiting "))
            )
            < 6
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Each request had thousands of steps left when the server was told to stop.
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    for r in plain:
        assert_openai_error(r, 503)
    # The port is free again: nothing listens, and a new server can bind it (connections the
    # server closed linger in TIME_WAIT, which `SO_REUSEADDR` allows, as uvicorn sets it).
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    log = proc.stderr.read()
    assert "Traceback" not in log and "CancelledError" not in log
