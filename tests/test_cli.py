"""The `jaxlm` command line, run as a user would: in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from conftest import SMOLLM2_LLAMACPP as REFERENCE
from conftest import default_model_env

JAXLM = Path(sys.executable).parent / "jaxlm"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return default_model_env(JAXLM_CACHE_DIR=str(tmp_path_factory.mktemp("jaxlm-cache")))


def run(env, *args, stdin=None):
    return subprocess.run(
        [str(JAXLM), *args], capture_output=True, text=True, env=env, input=stdin, timeout=600
    )


def test_generate_streams_the_reference_continuation(env):
    case = REFERENCE["generations"][0]
    out = run(env, "generate", case["prompt"], "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(" Paris.\n\nThe answer is")
    assert "Loading weights" not in out.stderr  # no progress bar when not on a terminal


def test_generate_says_why_it_wrote_nothing(env):
    # The reference continuation starts with " Paris", so this stop string ends it at once.
    case = REFERENCE["generations"][0]
    out = run(env, "generate", case["prompt"], "--max-new-tokens", "8", "--stop", " Paris")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "\n"
    assert "stopped before writing any text" in out.stderr


def test_python_dash_m(env):
    out = subprocess.run(
        [sys.executable, "-m", "jaxlm", "generate", "def fibonacci(n):", "--max-new-tokens", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("\n    if n")


def test_chat_session(env):
    out = run(env, "chat", "--max-new-tokens", "4", stdin="Hi!\n/reset\nHello\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) >= 2


def test_plan_prints_the_bill_without_loading_weights(env):
    # One step compiled: the bill's layout is the test's, each step's bill `tests/test_plan.py`'s.
    out = run(env, "plan", "--max-batch", "2", "--max-seq-len", "512", "--steps", "decode")
    assert out.returncode == 0, out.stderr
    assert "model.layers.29.self_attn" in out.stdout
    # Each row's 512 slots in two pages of 256: [4 pages, 3 KV heads, head_dim 64, 256 slots].
    assert "[4, 3, 64, 256]" in out.stdout
    assert "whole bill" in out.stdout


def test_plan_over_budget(env):
    # Below the weights' bytes no length fits, which the refusal says without compiling a
    # step; fitting a budget is `tests/test_plan.py`'s.
    out = run(env, "plan", "--max-seq-len", "1024", "--budget", "300MiB", "--steps", "decode")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1
    assert "over the budget" in out.stderr and "`max_seq_len=1024`" in out.stderr
    assert "no `max_seq_len` fits" in out.stderr and "before XLA's temporaries" in out.stderr


# Two processes over 6 devices, less `--process-id`.
HOSTS = ("--num-processes", "2", "--coordinator", "10.0.0.1:1234", "--mesh", "1,6")


@pytest.mark.parametrize(
    "args,message",
    [
        (("generate", "Hi", "--model", "/no/such/model.gguf"), "/no/such/model.gguf"),
        (("generate", "Hi", "--max-new-tokens", "0"), "--max-new-tokens"),
        (("generate", "Hi", "--temperature", "warm"), "--temperature"),
        (("generate", "Hi", "--top-p", "1.5"), "`top_p`"),
        (("chat", "--repetition-penalty", "0"), "`repetition_penalty`"),
        (("generate", "Hi", "--dtype", "int4"), "--dtype"),
        (("generate", "Hi", "--speculative", "eagle"), "invalid choice: 'eagle'"),
        (("generate", "Hi", "--num-speculative-tokens", "2"), "needs `speculative`"),
        (
            ("generate", "Hi", "--speculative", "ngram", "--draft-model", "same"),
            "give `--speculative` or `--draft-model`, not both",
        ),
        (("chat", "--draft-model", "/no/such/draft.gguf"), "`--draft-model` /no/such/draft.gguf"),
        (("generate", "Hi", "--draft-quantize", "int8"), "needs `--draft-model`"),
        (
            ("serve", "--speculative", "ngram", "--num-speculative-tokens", "17"),
            "`num_speculative_tokens` must be an integer from 1 to 16",
        ),
        (("serve", "--coordinator", "10.0.0.1:1234"), "need `--num-processes`, `--process-id` too"),
        (("serve", *HOSTS[:4], "--process-id", "0"), "need `--mesh` over the devices of all"),
        (
            ("serve", *HOSTS[:2], "--coordinator", "10.0.0.1", *HOSTS[4:], "--process-id", "0"),
            "`--coordinator` must be HOST:PORT, got '10.0.0.1'",
        ),
        (
            ("serve", *HOSTS, "--process-id", "2"),
            "`--process-id` must be from 0 to 1 (`--num-processes 2`), got 2",
        ),
        (("plan", "--max-seq-len", "64", "--steps", "prefill"), "invalid choice: 'prefill'"),
        (("translate", "Hi"), "invalid choice: 'translate'"),
        ((), "the following arguments are required"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(monkeypatch, capsys, args, message):
    # In this process: the arguments are checked before any model loads or anything compiles.
    import jaxlm
    from jaxlm import cli

    def no_load(*args, **kwargs):
        raise AssertionError("the command line loaded a model before checking its arguments")

    if "--model" not in args:
        monkeypatch.setattr(jaxlm, "load", no_load)
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.count("\n") == 1, stderr
    assert message in stderr


def test_serve_joins_the_processes_then_refuses_a_mesh_short_of_their_devices(monkeypatch, capsys):
    # In this process, with `jax.distributed.initialize` stood in for and 6 devices in all:
    # a mesh of 3 would leave process 1's devices out of every step.
    import jax

    import jaxlm
    from jaxlm import cli

    joined, options = {}, {}

    def no_load(*args, **kwargs):
        raise AssertionError("the command line loaded a model before checking the mesh")

    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: joined.update(kwargs))
    monkeypatch.setattr(jax.config, "update", lambda name, value: options.update({name: value}))
    monkeypatch.setattr(jax, "device_count", lambda: 6)
    monkeypatch.setattr(jaxlm, "load", no_load)
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)
    monkeypatch.setattr(cli, "_without_ynnpack", lambda *args: None)
    code = cli.main(["serve", *HOSTS[:4], "--mesh", "1,3", "--process-id", "1"])
    stderr = capsys.readouterr().err
    assert code == 2
    assert "`--mesh 1,3` holds 3 devices; across 2 processes it must hold all 6" in stderr
    assert joined == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}
    assert options == {"jax_cpu_collectives_implementation": "gloo"}


def test_the_sampling_options_reach_stream(monkeypatch, capsys):
    # In this process, with `jaxlm.load` and `jaxlm.stream` stood in for: the wiring alone
    # (`tests/test_speculative.py` and `test_default_model.py` check what drafting gives).
    import jaxlm
    from jaxlm import cli

    got = {}

    def stream(model, tokenizer, prompt, params, **kwargs):
        got.update(kwargs, prompt=prompt, params=params)
        yield jaxlm.Delta("te", [1])
        yield jaxlm.Delta("xt", [2], finish_reason="length")

    monkeypatch.setattr(jaxlm, "load", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(jaxlm, "stream", stream)
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    argv = ["generate", "Hi", "--speculative", "ngram", "--top-k", "5", "--stop", "!"]
    assert cli.main([*argv, "--num-speculative-tokens", "5"]) == 0
    assert capsys.readouterr().out == "text\n"
    assert got["prompt"] == "Hi" and got["speculative"] == "ngram"
    assert got["num_speculative_tokens"] == 5
    params = got["params"]
    assert isinstance(params, jaxlm.SamplingParams)
    assert params.top_k == 5 and params.stop == ["!"] and params.max_new_tokens == 64


def test_a_draft_model_reaches_stream(monkeypatch, capsys):
    # The same stand-ins: the draft model loads once, from `--model`'s file with its own
    # `--draft-quantize`, onto the model's `--mesh`, and `stream` drafts with it.
    import jaxlm
    from jaxlm import cli

    loads, got = [], {}

    def load(path, **kwargs):
        loads.append((path, kwargs["quantize"], kwargs["mesh"]))
        return object(), None

    def stream(model, tokenizer, prompt, params, **kwargs):
        got.update(kwargs, model=model)
        yield jaxlm.Delta("text", [1], finish_reason="length")

    monkeypatch.setattr(jaxlm, "load", load)
    monkeypatch.setattr(jaxlm, "stream", stream)
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    argv = ["generate", "Hi", "--model", "m.gguf", "--draft-model", "same", "--mesh", "1,2"]
    assert cli.main([*argv, "--draft-quantize", "int8", "--num-speculative-tokens", "4"]) == 0
    assert capsys.readouterr().out == "text\n"
    assert loads == [("m.gguf", None, (1, 2)), ("m.gguf", "int8", (1, 2))]
    assert got["speculative"] is not got["model"] and got["num_speculative_tokens"] == 4


def test_a_draft_model_reaches_the_served_engine(monkeypatch, capsys, tmp_path):
    # Stand-ins again: `jaxlm serve --draft-model` loads the draft beside the model and gives it
    # to the engine (`tests/test_draft_model.py` checks what the engine does with it).
    import types

    import jaxlm
    from jaxlm import cli, serve

    loads, got = [], {}
    config = types.SimpleNamespace(max_position_embeddings=64)

    def load(path, **kwargs):
        loads.append((path, kwargs["quantize"]))
        return types.SimpleNamespace(config=config), None

    def engine(model, tokenizer, **kwargs):
        got.update(kwargs, model=model)
        return types.SimpleNamespace(plan="plan")

    monkeypatch.setattr(jaxlm, "load", load)
    monkeypatch.setattr(jaxlm, "LLMEngine", engine)
    monkeypatch.setattr(serve, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)
    monkeypatch.setattr(cli, "_without_ynnpack", lambda *args: None)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)
    draft = tmp_path / "d.gguf"
    draft.touch()
    argv = ["serve", "--model", "m.gguf", "--draft-model", str(draft), "--draft-quantize", "int8"]
    assert cli.main([*argv, "--num-speculative-tokens", "2"]) == 0, capsys.readouterr().err
    assert loads == [("m.gguf", None), (str(draft), "int8")]
    assert got["speculative"] is not got["model"] and got["num_speculative_tokens"] == 2


def test_the_executable_reports_an_error_in_one_line(env):
    out = run(env, "generate", "Hi", "--top-p", "1.5")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1, out.stderr
    assert "`top_p`" in out.stderr
    assert "Traceback" not in out.stderr


def test_generate_and_chat_turn_off_ynnpack_for_float32_unless_told(monkeypatch):
    from jaxlm.cli import _without_ynnpack

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    # bfloat16 and int8 products run on YNNPACK.
    for dtype, quantize in ((jnp.bfloat16, None), (jnp.float16, None), (jnp.float32, "int8")):
        _without_ynnpack(dtype, quantize)
        assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    _without_ynnpack(jnp.float32, None)
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_dump_to=/tmp/x",
        "--xla_cpu_experimental_ynn_fusion_type=",
    ]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=dot")
    _without_ynnpack(jnp.float32, None)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=dot"


def test_plan_of_int8_weights(env):
    # The weights are billed without compiling more than the one step asked for.
    out = run(env, "plan", "--max-seq-len", "512", "--quantize", "int8", "--steps", "decode")
    assert out.returncode == 0, out.stderr
    assert "XLA `decode`" in out.stdout and "XLA `generate`" not in out.stdout
    # SmolLM2 by hand: 134,515,008 parameters, of which 61 norms of 576 stay float32; a float32
    # scale for each of the 49,152 rows of the embedding and 30 x 5,184 rows of the layers.
    norms, rows = 61 * 576, 49152 + 30 * (3 * 5 * 64 + 576 + 2 * 1536 + 576)
    expected = 134_515_008 - norms + 4 * (norms + rows)
    assert f"weights: {expected / 2**20:.2f} MiB" in out.stdout
    out = run(env, "plan", "--quantize", "int8", "--dtype", "float16")
    assert out.returncode == 2 and "`dtype` float16 is not accepted" in out.stderr


@pytest.mark.parametrize("jax_dir", ["", "jax-cache"])
def test_the_compilation_cache_is_jaxs_own_where_it_is_set(tmp_path, jax_dir):
    code = (
        "import jax; from jaxlm import cli; cli.enable_compilation_cache(); "
        "print(jax.config.jax_compilation_cache_dir)"
    )
    env = {
        **os.environ,
        "JAXLM_CACHE_DIR": str(tmp_path / "jaxlm"),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / jax_dir) if jax_dir else "",
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    expected = tmp_path / jax_dir if jax_dir else tmp_path / "jaxlm" / "xla"
    assert out.stdout.strip() == str(expected)
