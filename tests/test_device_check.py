"""`benchmarks/device_check.py`, the check to run on any accelerator, runs on the CPU here on a
tiny model: every check it makes passes, and it reports every figure."""

from __future__ import annotations

import json

from test_bench import load_benchmark


def test_device_check_passes_on_the_cpu(tiny_chat, tmp_path, capsys):
    check = load_benchmark("device_check")
    out = tmp_path / "report.json"
    argv = ["--model", str(tiny_chat), "--new-tokens", "8", "--repeats", "1", "--json", str(out)]
    assert check.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and report["ok"]
    assert report["max_logit_difference"] < 1e-4
    assert report["greedy_equal"] and report["stream_equal"] and report["engine_equal"]
    for figure in ("generate_batch1_tok_s", "generate_batch8_tok_s", "engine_tok_s"):
        assert report[figure] > 0
    printed = capsys.readouterr().out
    assert "whole bill" in printed and printed.rstrip().endswith("all checks passed")
