"""A check of jaxlm on whatever accelerator JAX sees: run it once on any new machine (a GPU, a TPU).

In order, each printed as it finishes:
- parity: a random Llama (grouped-query attention) saved by transformers, its logits against
  transformers' in float32 on the CPU (the largest difference), and greedy `generate` against
  transformers' greedy `generate`;
- on the model to time (`--model`, default: the default model): decode tokens/s of `generate`
  at batch 1 and 8 (the median of `--repeats` runs, the compile excluded) and the bill of the
  plan it made for 8 rows; `stream` against `generate`; the engine (`jaxlm.LLMEngine`) with 8
  concurrent greedy requests, each equal to `generate`'s row, and its output tokens/s.

In float32, every product runs at full precision (`jax.default_matmul_precision("highest")`):
JAX's default on a GPU multiplies float32 in TF32, whose rounding differs with the batch's
shapes, so on a random model's near ties the engine's tokens and `generate`'s would differ by
rounding alone (seen on an H200; docs/performance.md, "On a GPU: the device check").

It exits non-zero if a check fails. In the suite it runs on the CPU on a tiny model
(`tests/test_device_check.py`); the figures it prints there mean nothing.

Usage: python benchmarks/device_check.py [--model PATH] [--dtype bfloat16] [--new-tokens 64]
       [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

import jaxlm

# The random model of the parity check: small enough for any machine, with 4:1 query groups.
PARITY_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "Here is a haiku about autumn:",
    "import numpy as np",
    "The quick brown fox",
    "In 1969, the first person to walk on the Moon",
]


def parity(tmp: str) -> dict:
    """Logits and greedy tokens of a random Llama, jaxlm against transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**PARITY_CONFIG)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp)
    model, _ = jaxlm.load(tmp)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        want = reference(torch.tensor(ids)).logits.numpy()
        greedy = reference.generate(
            torch.tensor(ids[:1]), max_new_tokens=16, do_sample=False, min_new_tokens=16
        )[0, ids.shape[1] :].tolist()
    # Full float32 products on accelerators whose default is lower (TF32 on NVIDIA GPUs).
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(ids))
    tokens = jaxlm.generate(model, None, [ids[0].tolist()], max_new_tokens=16, stop_token_ids=[])
    return dict(
        max_logit_difference=float(np.abs(got - want).max()),
        greedy_equal=tokens[0].token_ids == greedy,
    )


def median_seconds(fn, repeats: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generation(model, tokenizer, new_tokens: int, repeats: int) -> dict:
    """`generate` at batch 1 and 8 (timed), `stream` against `generate`, and the engine's 8
    concurrent requests against `generate`'s batch of 8."""
    kw = dict(max_new_tokens=new_tokens, stop_token_ids=[])
    out = {}
    for batch in (1, 8):
        prompts = PROMPTS[:batch]
        result = {}

        def once(prompts=prompts, result=result):
            result["out"] = jaxlm.generate(model, tokenizer, prompts, **kw)

        seconds = median_seconds(once, repeats)
        out[f"generate_batch{batch}_tok_s"] = batch * new_tokens / seconds
    text, alone = jaxlm.generate(model, tokenizer, PROMPTS[0], **kw)[0].text, result["out"]
    streamed = jaxlm.stream(model, tokenizer, PROMPTS[0], **kw)
    out["stream_equal"] = "".join(d.text for d in streamed) == text
    out["text"] = text
    seq_len = max(len(tokenizer.encode(p)) for p in PROMPTS) + new_tokens
    # Room for every sequence at its longest, in pages of 16 tokens, and chunks of 16 prompt
    # tokens: two step widths to compile.
    pages = 1 + len(PROMPTS) * -(-seq_len // 16)
    sizes = dict(max_num_seqs=8, max_seq_len=seq_len, num_pages=pages, max_num_batched_tokens=16)
    with jaxlm.LLMEngine(model, tokenizer, **sizes) as engine:
        engine.generate(PROMPTS[:1], **kw)  # the steps are compiled; this warms the host side
        start = time.perf_counter()
        outs = engine.generate(PROMPTS, **kw)
        seconds = time.perf_counter() - start
    out["engine_equal"] = [o.token_ids for o in outs] == [o.token_ids for o in alone]
    out["engine_tok_s"] = len(PROMPTS) * new_tokens / seconds
    return out


def run(args) -> dict:
    report = dict(devices=[str(d) for d in jax.devices()], backend=jax.default_backend())
    print(f"devices: {report['devices']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report.update(parity(tmp))
    print(
        f"parity: largest logit difference {report['max_logit_difference']:.2e}, "
        f"greedy equal: {report['greedy_equal']}",
        flush=True,
    )
    model, tokenizer = jaxlm.load(args.model, dtype=args.dtype, progress=False)
    report["matmul_precision"] = "highest" if args.dtype == "float32" else "default"
    with jax.default_matmul_precision(report["matmul_precision"]):
        report.update(generation(model, tokenizer, args.new_tokens, args.repeats))
    # The plan `generate` made for the batch of 8, and its bill.
    plan = next(p for p in jaxlm.plans_of(model) if p.max_batch == 8)
    report["plan_total_bytes"] = plan.total_bytes
    print(plan, flush=True)
    print(
        f"generate: {report['text']!r}; stream equal: {report['stream_equal']}\n"
        f"decode tok/s: batch 1 {report['generate_batch1_tok_s']:.1f}, batch 8 "
        f"{report['generate_batch8_tok_s']:.1f}; engine, 8 requests: "
        f"{report['engine_tok_s']:.1f} (each equal to `generate` alone: {report['engine_equal']})",
        flush=True,
    )
    report["ok"] = bool(
        report["max_logit_difference"] < 1e-3
        and report["greedy_equal"]
        and report["stream_equal"]
        and report["engine_equal"]
    )
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print("all checks passed" if report["ok"] else "A CHECK FAILED", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
