"""The HTTP side of `serve.py`: streamed completions as a client sees them, and server processes.

One `httpx.AsyncClient` sends every request of a workload at its arrival time and reads each
answer as server-sent events, stamping every chunk that carries a token when it is read, so
TTFT and ITL include the server's HTTP layer and the network stack, as for any client.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# How to build llama.cpp's server when `--vs llama.cpp` finds no binary: from the sources
# llama-cpp-python vendors, so it is the same llama.cpp that `bench.py --vs llama.cpp` runs.
LLAMA_SERVER_BUILD = """\
pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llama-src
tar xzf /tmp/llama-src/llama_cpp_python-*.tar.gz -C /tmp/llama-src
cmake -S /tmp/llama-src/llama_cpp_python-*/vendor/llama.cpp -B /tmp/llama-build \\
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \\
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build /tmp/llama-build -j2 --target llama-server llama-bench
# then: --llama-server /tmp/llama-build/bin/llama-server (or LLAMA_SERVER=...)"""


class ServerError(Exception):
    """The server answered a request with an error status."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


def cores() -> int:
    return len(os.sched_getaffinity(0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (any `amx*` flag in /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag.startswith("amx") for flag in text.split())


async def stream_one(client, url: str, body: dict, prompt, max_tokens: int) -> dict:
    """One streamed completion: when it was sent, when each chunk with a token came, how many
    tokens the server says it made, its text, why it ended, and the server's own `timings`
    where it sends them (llama.cpp does, with its drafts' counts)."""
    body = {**body, "prompt": prompt, "max_tokens": max_tokens}
    times, pieces, tokens, finish, timings = [], [], None, None, None
    sent = time.perf_counter()
    async with client.stream("POST", url + "/completions", json=body) as r:
        if r.status_code != 200:
            raise ServerError(r.status_code, (await r.aread()).decode(errors="replace"))
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                # A chunk carries a token unless it only closes the stream: servers end with an
                # empty text and a finish reason, or put the last held-back text beside it.
                if choice.get("finish_reason") is None or choice.get("text"):
                    times.append(now)
                pieces.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    return dict(
        arrival=sent,
        times=times,
        tokens=len(times) if tokens is None else tokens,
        text="".join(pieces),
        finish_reason=finish,
        requested=max_tokens,
        timings=timings,
    )


def _client() -> httpx.AsyncClient:
    # No pool limit, so a burst of requests all reach the server at once rather than queueing
    # here; a read waits long, as a request may queue behind the server's running batch.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0))


async def _run(url: str, body: dict, requests, prompts) -> list[dict]:
    async with _client() as client:
        start = time.perf_counter()

        async def one(arrival, prompt, new):
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            return await stream_one(client, url, body, prompt, new)

        tasks = [
            one(arrival, prompt, new)
            for (arrival, _, new), prompt in zip(requests, prompts, strict=True)
        ]
        return await asyncio.gather(*tasks)


def run_http(url: str, body: dict, requests, prompts) -> list[dict]:
    """Send `requests` (`(arrival s, ids, output tokens)`, prompts as `prompts` gives them) to
    the OpenAI-compatible `url` (ending in `/v1`) at their arrival times, all streamed."""
    return asyncio.run(_run(url, body, requests, prompts))


def request_body(url: str) -> dict:
    """The fields every request shares: greedy, no early stop, the token count in the final
    chunk, and the server's model name where it lists one (jaxlm refuses other names)."""
    body = dict(stream=True, temperature=0, stream_options={"include_usage": True})
    # `ignore_eos` is vLLM's and llama.cpp's; jaxlm ignores it, as it does every field OpenAI
    # does not define.
    body["ignore_eos"] = True
    try:
        models = httpx.get(url + "/models", timeout=30).json()["data"]
        body["model"] = models[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        pass
    return body


def takes_token_ids(url: str, body: dict, ids: list[int]) -> bool:
    """Whether the server takes a prompt as a list of token ids, from one short request."""
    try:
        asyncio.run(_run(url, body, [(0.0, ids, 1)], [ids]))
    except ServerError as e:
        if 400 <= e.status < 500:
            return False
        raise
    return True


class Server:
    """A server process listening on 127.0.0.1:`port`: started, waited on until `/health`
    answers 200, and stopped with SIGTERM. Its output goes to a file, so it never blocks on a
    full pipe, and is shown when it fails to start."""

    def __init__(self, name: str, command: list[str], port: int, timeout: float = 900.0):
        self.name, self.command, self.timeout = name, command, timeout
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by `__exit__`)
        self.proc = None

    def __enter__(self) -> Server:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env, text=True
        )
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"{self.name} not healthy in {self.timeout} s:\n{self.tail()}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def tail(self, lines: int = 30) -> str:
        self.log.seek(0)
        return "".join(self.log.readlines()[-lines:])

    def cpu_seconds(self) -> float:
        """The CPU time the server process has used, user and system."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def jaxlm_server(
    model, port: int, max_num_seqs: int, max_seq_len: int, page_size: int, speculative=None
) -> Server:
    """`jaxlm serve` with the engine of the in-process run: every sequence fits at its
    longest, so none is preempted."""
    command = [sys.executable, "-m", "jaxlm", "serve", "--port", str(port)]
    command += ["--max-num-seqs", str(max_num_seqs), "--max-seq-len", str(max_seq_len)]
    command += ["--page-size", str(page_size)]
    if speculative is not None:
        command += ["--speculative", speculative]
    if model is not None:
        command += ["--model", str(model)]
    return Server("jaxlm serve", command, port)


def llama_server_binary(given, gguf: Path) -> tuple[str | None, str | None]:
    """The `llama-server` to run on `gguf` (`given`, else `$LLAMA_SERVER`), or None and why
    not; where there is none, how to build it is printed."""
    binary = given or os.environ.get("LLAMA_SERVER")
    if Path(gguf).suffix != ".gguf":
        return None, f"{gguf} is no GGUF file"
    if binary is None or not Path(binary).is_file():
        print(f"llama-server not found; build it with:\n{LLAMA_SERVER_BUILD}")
        return None, "no llama-server: give --llama-server PATH or LLAMA_SERVER"
    return binary, None


def llama_server(
    binary, gguf, port: int, max_num_seqs: int, max_seq_len: int, spec_type: str | None = None
) -> Server:
    """llama.cpp's `llama-server` on the GGUF file: a thread per core, `max_num_seqs` slots
    of `max_seq_len` tokens each, batched continuously, drafting with `--spec-type spec_type`
    where given. `--no-repack` keeps the weights in the file's layout where AMX would repack
    them, as `bench.py` runs llama.cpp."""
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", str(cores()), "-np", str(max_num_seqs), "-c", str(max_num_seqs * max_seq_len)]
    command += ["--cont-batching"]
    if spec_type is not None:
        command += ["--spec-type", spec_type]
    if has_amx():
        command += ["--no-repack"]
    return Server("llama-server", command, port)
