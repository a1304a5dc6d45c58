"""The benchmarks run end to end on a tiny model, so they cannot rot: structure only, no timings."""

from __future__ import annotations

import importlib.util
import json
import mmap
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model

from jaxlm import bench, cli

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """Import `benchmarks/<name>.py`, which is a script folder, not a package; as when a script
    runs, its folder is on the path, so the scripts import each other."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Give torch its thread count back after a benchmark set its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    """A tiny Llama with tied embeddings and linear RoPE scaling, saved by transformers."""
    path = tmp_path_factory.mktemp("bench_model")
    make_hf_model(path, "llama_gqa3_tied_linear")
    return path


def test_bench_writes_json_and_prints_tables(tiny_tied, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_tied), "--batch", "2", "--prompt-len", "5"]
    argv += ["--new-tokens", "4", "--repeats", "1", "--bandwidth-mib", "8", "--json", str(out)]
    argv += ["--vs", "transformers", "--vs", "llama.cpp"]
    cache_dir = jax.config.jax_compilation_cache_dir
    report = bench.run(cli.parser().parse_args(argv))
    printed = capsys.readouterr().out

    assert jax.config.jax_compilation_cache_dir == cache_dir
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert set(data) >= {"machine", "model", "bandwidth", "baseline_rss_bytes", "cells"}
    assert data["bandwidth"]["bytes_per_s"] > 0
    assert data["model"]["weights_bytes"] == data["model"]["weights_read_per_step_bytes"] > 0
    # The grid has no batch 1 and the model is no GGUF file: llama.cpp is skipped, with a reason.
    assert "llama.cpp" in data["skipped"]
    (cell,) = data["cells"]
    assert (cell["batch"], cell["prompt_len"], cell["new_tokens"]) == (2, 5, 4)
    j = cell["jaxlm"]
    for key in ("prefill_tok_s", "ttft_s", "first_call_cold_s", "first_call_cached_s"):
        assert j[key] > 0, key
    for key in ("peak_rss_bytes", "rss_bytes", "plan_total_bytes", "bandwidth_limit_steps_s"):
        assert j[key] > 0, key
    assert j["compiles_cold"] >= 1
    assert j["peak_rss_since"] == "generation"
    resident = j["plan_total_bytes"] + j["plan_executables_host_bytes"]
    assert j["predicted_peak_bytes"] == data["baseline_rss_bytes"] + resident
    # Decode rates come from a difference of times, which noise may make meaningless here.
    assert j["decode_tok_s"] is None or j["decode_tok_s"] > 0
    assert cell["transformers"]["prefill_tok_s"] > 0
    ratios = cell["ratios"]["transformers"]
    assert len(ratios["prefill_tok_s"]["pairs"]) == 1
    # The same weights give the same greedy tokens: the conversion to transformers is right.
    assert ratios["same_tokens"] == 4
    for text in ("prefill tok/s", "decode tok/s", "transformers", "llama.cpp", "jaxlm/it decode"):
        assert text in printed, text


def test_peak_rss_restarts_after_a_reset():
    # 256 MiB mapped, touched and unmapped raise the high-water mark; a reset brings it back to
    # about the current RSS, as the kernel counts it. (An array could take free heap pages that
    # are resident already, and its free keep them: the mapping is the process's own.)
    block = mmap.mmap(-1, 2**28)
    np.frombuffer(block, np.uint8).fill(1)
    high = bench.peak_rss()
    block.close()
    assert high >= bench.current_rss() + 200 * 2**20
    assert bench.reset_peak_rss()
    assert bench.peak_rss() < high - 200 * 2**20


def test_gil_benchmark_measures_every_workload(tiny_tied):
    gil = load_benchmark("gil")
    results = gil.run(str(tiny_tied), prompt_len=5, new_tokens=4, seconds=0.05, repeats=1)
    assert set(results["workloads"]) == {"generate", "python loop", "engine", "transformers"}
    assert results["busy_alone_it_s"] > 0
    for w in results["workloads"].values():
        assert w["alone_tok_s"] > 0
        assert w["beside_tok_s"] > 0
        assert w["busy_beside_it_s"] > 0
    table = gil.format_table(results)
    assert "python loop" in table
    assert any(line.split()[0] == "engine" for line in table.splitlines()[1:] if line.strip())
    assert "busy beside/alone" in table


def test_memory_plan_runs_a_size_in_a_child_process(tiny_tied, capsys):
    memory_plan = load_benchmark("memory_plan")
    # 2 layers x 2 KV heads x 8 dims x 2 (K and V) x 4 bytes: 64 KiB is 256 slots.
    assert memory_plan.main(["--model", str(tiny_tied), "--sizes", "0.0625", "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "not donated ms" in printed
    row = printed.splitlines()[2].split()
    assert row[1] == "256"


def test_matmul_step_variants_compute_the_same(tiny_tied, tmp_path, capsys):
    matmul_step = load_benchmark("matmul_step")
    out = tmp_path / "matmul.json"
    argv = ["--model", str(tiny_tied), "--rows", "1,2", "--steps", "2", "--rounds", "1"]
    assert matmul_step.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {(r["variant"], r["rows"]) for r in report["results"]} == {
        (v, m) for v in matmul_step.VARIANTS for m in (1, 2)
    }
    # Every layout and fusion computes what the model's own weights compute.
    for r in report["results"]:
        assert r["max_abs_diff"] < 1e-4, r
        assert r["median_ms"] > 0
    # Two layers of q, k, v, o, gate, up, down and the tied head, in float32.
    h, q, kv, mlp, vocab = 48, 48, 16, 112, 96
    assert report["weight_bytes"] == 4 * (2 * (2 * h * q + 2 * h * kv + 3 * h * mlp) + h * vocab)
    assert "fused qkv, gate/up" in capsys.readouterr().out


@pytest.mark.parametrize("cols", [1, 3])
@pytest.mark.parametrize("variant", ["int8 rows", "int8 blocks"])
def test_int8_step_products_equal_numpy(variant, cols):
    int8_step = load_benchmark("int8_step")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 72), np.float32)
    x = rng.standard_normal((72, cols), np.float32)

    def quantize(a, axis):
        scale = np.abs(a).max(axis=axis, keepdims=True) / 127
        return np.round(a / np.where(scale == 0, 1, scale)).astype(np.int64), scale

    if variant == "int8 rows":
        (wq, ws), (xq, xs) = quantize(w, 1), quantize(x, 0)
        expected = (wq @ xq) * ws * xs
    else:
        # Blocks of 32 along the input, the input padded with zeros to 96.
        wb = np.pad(w, ((0, 0), (0, 24))).reshape(40, 3, 32)
        xb = np.pad(x, ((0, 24), (0, 0))).reshape(3, 32, cols)
        (wq, ws), (xq, xs) = quantize(wb, 2), quantize(xb, 1)
        expected = (np.einsum("obk,bkc->obc", wq, xq) * ws * xs[:, 0][None]).sum(axis=1)
    stored = int8_step.quantize_weight(jnp.asarray(w), variant)
    got = jax.jit(lambda w, x: int8_step.product(w, x, variant))(stored, jnp.asarray(x))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_int8_step_runs_every_variant(tiny_tied, tmp_path):
    int8_step = load_benchmark("int8_step")
    out = tmp_path / "int8.json"
    argv = ["--model", str(tiny_tied), "--rows", "1,2", "--steps", "2", "--rounds", "1"]
    assert int8_step.main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {(r["variant"], r["rows"]) for r in results} == {
        (v, m) for v in int8_step.VARIANTS for m in (1, 2)
    }
    weights = {r["variant"]: r["weight_bytes"] for r in results}
    assert weights["int8 rows"] < weights["bfloat16"] < weights["float32"]


def test_int4_step_runs_every_variant(capsys):
    int4_step = load_benchmark("int4_step")
    assert int4_step.main(["--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert all(v in out for v in ("int8", "int4, to int8 in the loop", "int4 in the dot"))


def test_int8_quality_rounds_as_numpy_does(tiny_chat, tmp_path):
    int8_quality = load_benchmark("int8_quality")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 24, 40), np.float32)
    x = rng.standard_normal((40, 1, 3), np.float32)

    def rounded(a, axis):
        scale = np.abs(a).max(axis=axis, keepdims=True) / 127
        return np.round(a / scale) * scale

    # Blocks of 32 along the 40 features: one of 32 and one of 8 (padded with zeros).
    w_blocks = np.concatenate([rounded(w[..., :32], -1), rounded(w[..., 32:], -1)], axis=-1)
    x_flat = x.reshape(40, 3)
    x_blocks = np.concatenate([rounded(x_flat[:32], 0), rounded(x_flat[32:], 0)], axis=0)
    expected = np.einsum("sok,kc->soc", w_blocks, x_blocks).reshape(2, 24, 1, 3)
    got = int8_quality.simulated("blocks of 32")(jnp.asarray(w), jnp.asarray(x))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # A rotation is orthogonal, so it changes nothing before the rounding.
    r = int8_quality.rotation(128)
    np.testing.assert_allclose(r @ r.T, np.eye(128), atol=1e-6)

    out = tmp_path / "quality.json"
    assert int8_quality.main(["--model", str(tiny_chat), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["scheme"] for r in report["results"]] == [*int8_quality.SCHEMES, "jaxlm int8"]
    for r in report["results"]:
        assert r["mean_kld"] >= 0 and 0 <= r["top1"] <= 1
    same = rng.standard_normal((5, 7))
    assert int8_quality.divergence(same, same) == (0.0, 1.0)


def test_serve_benchmark_times_every_request(tiny_tied, tmp_path, capsys):
    serve = load_benchmark("serve")
    out = tmp_path / "serve.json"
    argv = ["--model", str(tiny_tied), "--requests", "6", "--rate", "50", "--max-num-seqs", "2"]
    # The longest prompt fits one chunk of 16 tokens: the engine compiles that width's steps,
    # not those of every width up to the default 256.
    argv += ["--prompt-len", "3,9", "--output-len", "2,5", "--page-size", "4"]
    argv += ["--max-num-batched-tokens", "16"]
    with pytest.raises(SystemExit):
        serve.main([*argv, "--max-seq-len", "13"])
    assert "`--max-seq-len` 13 is below the workload's longest, 14" in capsys.readouterr().err
    assert serve.main([*argv, "--max-seq-len", "32", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"LLMEngine", "static generate"}
    for r in results.values():
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert 0 <= r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
    # Static batching hands a request's tokens over at once: no gaps between them.
    assert results["static generate"]["itl_s"]["p50"] == 0
    # The workload is the same at every call: a fixed seed.
    requests = serve.workload(6, 50, (3, 9), (2, 5), vocab=96)
    assert requests == serve.workload(6, 50, (3, 9), (2, 5), vocab=96)
    assert all(3 <= len(p) <= 9 and 2 <= n <= 5 for _, p, n in requests)


@pytest.mark.parametrize(
    "engine",
    # Steps of at most 64 tokens: the engine compiles 5 shapes of prompt chunks, not 9.
    [
        [],
        [
            *("--engine", "--max-num-seqs", "2", "--copies", "2"),
            *("--max-num-batched-tokens", "64", "--vs", "llama.cpp"),
        ],
        ["--draft-model", "same", "--draft-quantize", "int8"],
    ],
    ids=["generate", "engine", "draft model"],
)
def test_speculative_benchmark_gives_the_same_tokens_both_ways(tiny_chat, tmp_path, engine):
    speculative = load_benchmark("speculative")
    out = tmp_path / "speculative.json"
    # The tiny model's context holds the shortest prompt.
    argv = ["--model", str(tiny_chat), "--tasks", "explain", "--new-tokens", "12", "--repeats", "1"]
    argv += ["--num-speculative-tokens", "2"]
    assert speculative.main([*argv, *engine, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    tasks = ["explain (alone)", "all tasks x2, 2 slots"] if "--engine" in engine else ["explain"]
    assert [r["task"] for r in results] == tasks
    assert all(r["same_tokens"] and r["accepted"] <= r["drafted"] for r in results)
    assert all(r["drafted"] % 2 == 0 for r in results)
    assert all(r["plain_tok_s"] > 0 and r["drafted_tok_s"] > 0 for r in results)
    if "--draft-model" in engine:
        assert json.loads(out.read_text())["drafts"] == "draft model (same, int8)"
    if "--engine" in engine:
        # llama.cpp runs GGUF files only, and says so rather than failing the run.
        report = json.loads(out.read_text())
        assert report["llama.cpp"] == []
        assert report["skipped"] == {"llama.cpp": f"{tiny_chat} is no GGUF file"}


def test_serve_benchmark_over_http_times_every_request(tiny_chat, tmp_path):
    serve = load_benchmark("serve")
    http_client = serve.http_client
    port = http_client.free_port()
    command = [sys.executable, "-m", "jaxlm", "serve", "--model", str(tiny_chat)]
    command += ["--port", str(port), "--max-num-seqs", "2", "--max-seq-len", "64"]
    command += ["--page-size", "4", "--max-num-batched-tokens", "16", "--speculative", "ngram"]
    out = tmp_path / "serve.json"
    url = f"http://127.0.0.1:{port}/v1"
    argv = ["--model", str(tiny_chat), "--url", url, "--requests", "6", "--rate", "50"]
    argv += ["--max-num-seqs", "2", "--prompt-len", "3,9", "--output-len", "2,5"]
    with http_client.Server("jaxlm serve", command, port, timeout=300):
        assert serve.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {url} and report["skipped"] == {}
    r = report["results"][url]
    assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s"):
        assert 0 <= r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"], key
    server = report["servers"][url]
    assert server["prompts"] == "token ids"  # jaxlm takes a prompt as a list of token ids
    # A server this did not start has no CPU time to set apart from the other processes'.
    assert server["load"] is None and server["server_cores"] is None
    vocab = serve.ModelConfig.from_hf_config(json.loads((tiny_chat / "config.json").read_text()))
    requests = serve.workload(6, 50, (3, 9), (2, 5), vocab=vocab.vocab_size)
    assert len(server["requests"]) == len(requests)
    for timed, (_, _, new) in zip(server["requests"], requests, strict=True):
        assert timed["ttft_s"] > 0 and 1 <= timed["chunks"] <= new
        assert timed["output_tokens"] == timed["requested_tokens"] == new
        assert timed["finish_reason"] == "length"
