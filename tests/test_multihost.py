"""Two JAX processes on one machine, each with 3 simulated CPU devices, joined over loopback.

The processes (`tests/multihost_worker.py`) call `jax.distributed.initialize` on 127.0.0.1
with a free port and JAX's gloo CPU collectives, then use two `(data, model)` meshes over the
6 devices, process 0's first:

- `(2, 3)`: each row of the mesh is one process, so the batch splits across the processes and
  tensor parallelism stays inside each; the generated tokens are gathered across processes, and
  the engine's slots and pages split across them.
- `(1, 6)`: each process holds a `(1, 3)` block of the `model` axis, which spans both, so the
  model-parallel collectives go from process to process: the reductions after the row-parallel
  o and down projections, and the gathers of the vocabulary split over the LM head (the model
  has 6 KV heads and a vocabulary of 324, both split 6 ways).

A single process with 6 simulated devices runs the same meshes as the reference, and the same
model on one device without a mesh. Then, while both processes generate in a loop, process 1
is killed: process 0 must fail on its own within JAX's heartbeat timeout (set short) and a
margin, naming the failure. Last, `jaxlm serve` runs as two such processes on the `(1, 6)`
mesh: process 0 answers the engine's requests as the single process's engine does, and both
exit once process 0 is stopped. Every wait is bounded, and the processes are killed if the
test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from conftest import FAST_COMPILE_FLAGS, save_tokenizer
from multihost_worker import (
    ENGINE,
    ENGINE_LAYOUT,
    ENGINE_PROMPTS,
    ENGINE_TOKENS,
    HEARTBEAT_TIMEOUT,
    LAYOUTS,
    MAX_SEQ_LEN,
)

from jaxlm.batching import lockstep

WORKER = Path(__file__).parent / "multihost_worker.py"
# Seconds for the servers to start and to stop once process 0 is told to.
SERVE_TIMEOUT = 300
STOP_TIMEOUT = 60
# Seconds for the three processes to write their results, on a slow shared machine.
RESULTS_TIMEOUT = 480
# Seconds for the survivor to fail once the other process is killed: the heartbeat timeout,
# then the time to report it.
FAILURE_BOUND = HEARTBEAT_TIMEOUT + 30
# How the survivor ends: JAX's distributed client terminates it, having learnt of the death
# from the coordination service (the killed process stopped sending heartbeats) or from gloo
# (its connection to the killed process broke in a collective: the Python error that follows
# ends the process, whose shutdown then fails at the barrier the killed process never joins).
JAX_FAILURE = "Terminating process because the JAX distributed service detected fatal errors"
DEATH_CAUSES = (
    "stopped sending heartbeats",
    "Connection reset by peer",
    "Connection closed by peer",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model(path: Path) -> None:
    vocab = save_tokenizer(path, vocab_size=324)
    assert vocab % 6 == 0, vocab
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=6,
        max_position_embeddings=MAX_SEQ_LEN + 256,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _start(name: str, tmp: Path, devices: int, argv: list) -> subprocess.Popen:
    # Without XLA:CPU's YNNPACK fusions, as `jaxlm serve` runs a float32 model: the servers
    # then find the engine's steps that the workers compiled in the compilation cache.
    flags = (
        f"--xla_force_host_platform_device_count={devices} --xla_cpu_experimental_ynn_fusion_type="
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{FAST_COMPILE_FLAGS} {flags}"}
    with open(tmp / f"{name}.out", "w") as out, open(tmp / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, *map(str, argv)], env=env, stdout=out, stderr=err)


def _logs(tmp: Path, names) -> str:
    return "\n".join(
        f"--- {name} stderr ---\n{(tmp / f'{name}.err').read_text()[-4000:]}" for name in names
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("model")
    _tiny_model(model)
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir):
    """Each process's results, and how the survivor ended once the other was killed."""
    tmp = tmp_path_factory.mktemp("multihost")
    model = model_dir
    port = _free_port()
    files = {name: tmp / f"{name}.json" for name in ("reference", "process 0", "process 1")}
    procs = {
        "reference": _start("reference", tmp, 6, [WORKER, model, files["reference"], 1, 0, 0]),
        **{
            f"process {i}": _start(
                f"process {i}", tmp, 3, [WORKER, model, files[f"process {i}"], 2, i, port]
            )
            for i in (0, 1)
        },
    }
    try:
        deadline = time.monotonic() + RESULTS_TIMEOUT
        while not all(f.exists() for f in files.values()):
            for name, proc in procs.items():
                if proc.poll() is not None and not files[name].exists():
                    pytest.fail(
                        f"{name} exited with {proc.returncode} without results\n"
                        + _logs(tmp, procs)
                    )
            if time.monotonic() > deadline:
                pytest.fail(f"no results after {RESULTS_TIMEOUT} s\n" + _logs(tmp, procs))
            time.sleep(0.2)
        assert procs["reference"].wait(timeout=60) == 0, _logs(tmp, ["reference"])
        # Both processes now generate in a loop; kill one in the middle of it.
        procs["process 1"].kill()
        killed = time.monotonic()
        try:
            code = procs["process 0"].wait(timeout=FAILURE_BOUND)
        except subprocess.TimeoutExpired:
            code = None
        survivor = {
            "returncode": code,
            "seconds": time.monotonic() - killed,
            "stderr": (tmp / "process 0.err").read_text(),
        }
        results = {name: json.loads(f.read_text()) for name, f in files.items()}
        return results, survivor
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_the_meshes_lay_out_the_axes_across_the_processes(runs):
    results, _ = runs
    for i in (0, 1):
        seen = results[f"process {i}"]
        assert seen["data across processes"]["processes"] == [[0, 0, 0], [1, 1, 1]]
        assert seen["model across processes"]["processes"] == [[0, 0, 0, 1, 1, 1]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generate_and_stream_give_the_single_process_tokens(runs, layout):
    results, _ = runs
    reference = results["reference"][layout]
    # The reference on the mesh agrees with the model on one device, and with its own stream.
    assert reference["token_ids"] == results["reference"]["one device"]["token_ids"]
    assert reference["stream"] == reference["texts"]
    assert all(len(ids) == 12 for ids in reference["token_ids"])
    for i in (0, 1):
        seen = results[f"process {i}"][layout]
        assert seen["token_ids"] == reference["token_ids"], f"process {i}"
        assert seen["texts"] == reference["texts"], f"process {i}"
        assert seen["stream"] == reference["stream"], f"process {i}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_per_device_bill_is_the_single_host_one(runs, layout):
    results, _ = runs
    reference = results["reference"][layout]["bill"]
    assert reference["scratch"] > 0 and reference["weights"] > 0
    for i in (0, 1):
        assert results[f"process {i}"][layout]["bill"] == reference, f"process {i}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_budget_picks_the_single_host_max_seq_len(runs, layout):
    results, _ = runs
    reference = results["reference"][layout]
    # The budget is the decode step's bill at `MAX_SEQ_LEN`, below that of the next page up.
    assert reference["budget_max_seq_len"] == MAX_SEQ_LEN
    for i in (0, 1):
        seen = results[f"process {i}"][layout]
        assert seen["budget"] == reference["budget"], f"process {i}"
        assert seen["budget_max_seq_len"] == MAX_SEQ_LEN, f"process {i}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_engine_runs_the_same_requests_on_both_processes(runs, layout):
    # Process 0 serves eight requests and cancels a ninth; process 1 follows. Each runs them
    # as one process with the whole mesh does, and as the model on one device does; with `data`
    # across the processes, each process holds the pages of its own slots.
    results, _ = runs
    reference = results["reference"][layout]["engine"]
    assert reference == results["reference"]["one device"]["engine"]
    assert [len(ids) for ids in reference["token_ids"]] == ENGINE_TOKENS
    assert reference["pages_in_use"] == 0
    leader = results["process 0"][layout]["engine"]
    follower = results["process 1"][layout]["engine"]
    assert leader["token_ids"] == reference["token_ids"]
    # The follower hands out its requests as they finish.
    assert sorted(follower["token_ids"]) == sorted(reference["token_ids"])
    assert follower["cancelled"] == 1
    assert "process 0 takes the requests" in follower["refused"]
    for seen in (leader, follower):
        assert seen["pages_in_use"] == 0
        assert seen["finished"] == len(ENGINE_TOKENS)
        # Running from the start (a follower's steps run in `follow()`), not once closed.
        assert seen["running"] == [True, False]


@pytest.mark.parametrize("tokens", [0, 1000, 3 * lockstep.CHUNK])
def test_the_engine_events_cross_in_chunks_of_any_number(tokens):
    # On one process a broadcast hands back what it is given: the payload's size, in the first
    # chunk, and the chunks after it come back as the events.
    submit = lockstep.Submit(list(range(tokens)), None, ("group", 1), "ngram")
    events = [submit, lockstep.Cancel(7), lockstep.Close()]
    assert lockstep.exchange(events) == events


def test_a_killed_process_fails_the_other_within_the_heartbeat_timeout(runs):
    _, survivor = runs
    assert survivor["returncode"] is not None, (
        f"process 0 still ran {FAILURE_BOUND} s after process 1 was killed\n" + survivor["stderr"]
    )
    assert survivor["returncode"] != 0
    assert survivor["seconds"] < FAILURE_BOUND, survivor["seconds"]
    stderr = survivor["stderr"]
    assert JAX_FAILURE in stderr, stderr[-4000:]
    assert any(cause in stderr for cause in DEATH_CAUSES), stderr[-4000:]


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir, runs):
    """`jaxlm serve` as two processes on the engine's layout, after `runs` (whose steps the
    compilation cache then holds): the engine's requests sent to process 0 at once, what each
    process wrote and how each ended once process 0 was stopped."""
    tmp = tmp_path_factory.mktemp("serve")
    http = _free_port()
    options = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    argv = [
        *("-m", "jaxlm", "serve", "--model", model_dir, "--served-model-name", "tiny"),
        *("--port", http, "--mesh", "1,6"),
        *("--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", 2, *options),
    ]
    procs = {
        f"server {i}": _start(f"server {i}", tmp, 3, [*argv, "--process-id", i]) for i in (0, 1)
    }
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        while not _healthy(base):
            for name, proc in procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with {proc.returncode}\n" + _logs(tmp, procs))
            if time.monotonic() > deadline:
                pytest.fail(f"no server after {SERVE_TIMEOUT} s\n" + _logs(tmp, procs))
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

        def complete(request):
            prompt, tokens = request
            return client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
                timeout=SERVE_TIMEOUT,
            )

        with ThreadPoolExecutor(len(ENGINE_PROMPTS)) as pool:
            completions = list(pool.map(complete, zip(ENGINE_PROMPTS, ENGINE_TOKENS, strict=True)))
        procs["server 0"].send_signal(signal.SIGTERM)
        codes = {name: proc.wait(timeout=STOP_TIMEOUT) for name, proc in procs.items()}
        return completions, codes, tmp
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_serve_across_two_processes_answers_as_one_process(runs, served):
    # Process 0 takes the eight requests at once, over more than the engine's slots, and both
    # processes run the steps: each answer is what one process with the whole mesh gives.
    results, _ = runs
    completions, codes, tmp = served
    logs = {name: (tmp / f"{name}.err").read_text() for name in codes}
    reference = results["reference"][ENGINE_LAYOUT]["engine"]
    assert [c.choices[0].text for c in completions] == reference["texts"]
    assert [c.usage.completion_tokens for c in completions] == ENGINE_TOKENS
    assert all(c.choices[0].finish_reason == "length" for c in completions)
    assert "serving at" in logs["server 0"] and "serving at" not in logs["server 1"]
    assert "running the steps of process 0" in logs["server 1"]
    # Stopping process 0's server closes the engine, which ends process 1's too.
    assert codes == {"server 0": 0, "server 1": 0}, _logs(tmp, codes)
