"""What `tests/test_serve_attack.py` serves its probes with: a server as `jaxlm serve` runs it,
the log's records, checks of an answer, and the hostile bodies, as data."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import httpx

import jaxlm
from jaxlm.serve import http
from jaxlm.serve.protocol import MESSAGE_CHARS

MODEL = "tiny"


class Running:
    """An app served as `jaxlm serve` serves it (`jaxlm.serve.http.config`) on a free port of
    127.0.0.1, in a thread of this process."""

    def __init__(self, app):
        config = http.config(app, host="127.0.0.1", port=0, grace=0, log_level="warning")
        self.server = http.DrainingServer(config, app.state.server, grace=0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join()


@contextlib.contextmanager
def served_default_engine(model, tokenizer, name: str):
    """`(Running, engine)`: the default model's engine at the sizes the serve tests share
    (`served_default` in `tests/conftest.py`), served as `name`."""
    from jaxlm.serve import create_app

    engine = jaxlm.LLMEngine(
        model,
        tokenizer,
        max_num_seqs=8,
        max_seq_len=1024,
        page_size=16,
        # One prompt chunk of 16 tokens a step: half the steps to compile of 64.
        max_num_batched_tokens=16,
        # Every request drafts where it can: the tests of served answers check drafted tokens.
        speculative="ngram",
    )
    running = Running(create_app(engine, name))
    try:
        yield running, engine
    finally:
        running.stop()
        engine.close()


class Records(logging.Handler):
    """Every record of the server's loggers (uvicorn's do not reach the root logger)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(self.format(r) for r in self.records)


def idle(engine, timeout=60.0):
    """The engine's stats once it has nothing left to run (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while (s := engine.stats()).running + s.waiting and time.monotonic() < deadline:
        time.sleep(0.02)
    return s


def generated(client) -> float:
    """`jaxlm_generation_tokens_total`, read from `/metrics`."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("jaxlm_generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no `jaxlm_generation_tokens_total` in /metrics")


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500 if status is None else r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert len(error["message"]) <= MESSAGE_CHARS + 3
    assert "Traceback" not in r.text and "Error:" not in r.text
    return error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc, url: str, timeout: float) -> None:
    """Wait for the server `proc` started to answer `/health` with 200, while it runs."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"no answer from {url} within {timeout} s"
        time.sleep(0.2)


# Hostile bodies: (path, raw body, the status and the `param` the error must name).
GOOD = b'{"model": "tiny", "prompt": %s, "max_tokens": 2}'
CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": %s}], "max_tokens": 2}'
DEEP = b"[" * 10_000 + b"]" * 10_000
HOSTILE = {
    "escaped surrogate in prompt": ("/v1/completions", GOOD % b'"a\\ud800b"', 400, "prompt"),
    "raw surrogate in prompt": ("/v1/completions", GOOD % b'"a\xed\xa0\x80b"', 400, "prompt"),
    "bytes not UTF-8 in prompt": ("/v1/completions", GOOD % b'"a\xff\xfeb"', 400, "prompt"),
    "surrogate in a list of prompts": (
        "/v1/completions",
        GOOD % b'["fine", "\\udfff"]',
        400,
        "prompt[1]",
    ),
    "surrogate in chat content": (
        "/v1/chat/completions",
        CHAT % b'"hi \\ud83d"',
        400,
        "messages[0].content",
    ),
    "raw surrogate in chat content": (
        "/v1/chat/completions",
        CHAT % b'"hi \xed\xb0\x80"',
        400,
        "messages[0].content",
    ),
    "surrogate in a text part": (
        "/v1/chat/completions",
        CHAT % b'[{"type": "text", "text": "\\ud800"}]',
        400,
        "messages[0].content[0].text",
    ),
    "surrogate in model": (
        "/v1/completions",
        b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}',
        400,
        "model",
    ),
    "surrogate in an ignored key": (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}',
        400,
        "\ufffd",
    ),
    "deep nesting in an ignored field": (
        "/v1/completions",
        b'{"prompt": "hi", "user": ' + DEEP + b"}",
        400,
        None,
    ),
    "deep nesting in prompt": ("/v1/completions", GOOD % DEEP, 400, None),
    "deep nesting at the top": ("/v1/chat/completions", DEEP, 400, None),
    "deep objects": ("/v1/completions", b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, None),
    "a large model name": (
        "/v1/completions",
        b'{"model": "%s", "prompt": "hi"}' % (b"m" * 2**20),
        404,
        "model",
    ),
    "a large role": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "%s", "content": "hi"}]}' % (b"r" * 2**20),
        400,
        "messages[0].role",
    ),
    "top_k beyond int32": ("/v1/completions", b'{"prompt": "hi", "top_k": 1099511627776}', 400),
    "top_k fractional": ("/v1/completions", b'{"prompt": "hi", "top_k": 2.5}', 400, "top_k"),
    "temperature NaN": ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    "temperature Infinity": ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400),
    "temperature beyond a float": (
        "/v1/completions",
        b'{"prompt": "hi", "temperature": 1%s}' % (b"0" * 400),
        400,
        "temperature",
    ),
    "an integer of 5000 digits": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 1%s}' % (b"0" * 5000),
        400,
        None,
    ),
    "max_tokens beyond the context": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 1000000000000}',
        400,
        "max_tokens",
    ),
    "five stop strings": (
        "/v1/completions",
        b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}',
        400,
        "stop",
    ),
    "a stop string of 20000 characters": (
        "/v1/completions",
        b'{"prompt": "hi", "stop": ["%s"]}' % (b"s" * 20_000),
        400,
        "stop",
    ),
    "n above max_num_seqs": ("/v1/completions", b'{"prompt": "hi", "n": 9}', 400, "n"),
    "a token id beyond the vocabulary": (
        "/v1/completions",
        b'{"prompt": [1, 99999999], "max_tokens": 2}',
        400,
        "prompt",
    ),
    "a body of ints that nests nothing": (
        "/v1/completions",
        b'{"prompt": [%s]}' % b",".join([b"1"] * 200_000),
        400,
        "max_tokens",
    ),
}
