"""Serving a stream of requests: `LLMEngine`'s continuous batching against static batches.

The same requests (random prompts and output lengths from a fixed seed, no stop tokens) arrive
at Poisson times at `--rate` requests per second (`inf`: all at once) and are served twice:
- `LLMEngine`: each request submitted when it arrives, its tokens streamed as they come;
- static: `jaxlm.generate` on the requests that have arrived, up to `--max-num-seqs` at once,
  each batch run until its longest request is done and the next batch started after it; a
  request's tokens all come when its batch ends.
Each runs the whole stream once to compile and warm up, then again for the figures: requests
and output tokens per second, TTFT (arrival to first token), TPOT ((last token - first token)
/ (tokens - 1)) and ITL (gaps between tokens), p50 / p90 / p99.

Usage: python benchmarks/serve.py [--model PATH] [--requests 32] [--rate 4] [--max-num-seqs 8]
    [--prompt-len 16,128] [--output-len 16,128] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

import jaxlm
from jaxlm.bench import OtherLoad, text_table


def workload(n: int, rate: float, prompt_len, output_len, vocab: int, seed: int = 0):
    """`n` requests `(arrival s, prompt ids, output tokens)`, arrivals from time 0."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, n) if np.isfinite(rate) else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, n)
    outputs = rng.integers(output_len[0], output_len[1] + 1, n)
    return [
        (float(t), rng.integers(0, vocab, int(p)).tolist(), int(o))
        for t, p, o in zip(arrivals, lengths, outputs, strict=True)
    ]


def run_engine(engine, requests) -> list[dict]:
    start = time.perf_counter()
    handles = [None] * len(requests)

    def feed():
        for i, (arrival, prompt, new) in enumerate(requests):
            time.sleep(max(0.0, start + arrival - time.perf_counter()))
            handles[i] = engine.submit(prompt, max_new_tokens=new, stop_token_ids=[])

    feeder = threading.Thread(target=feed)
    feeder.start()
    feeder.join()
    out = []
    for (arrival, _, new), handle in zip(requests, handles, strict=True):
        result = handle.result()
        assert len(result.token_ids) == new
        out.append(dict(arrival=start + arrival, times=list(handle.token_times)))
    return out


def run_static(model, requests, max_batch: int) -> list[dict]:
    start = time.perf_counter()
    pending, out = list(enumerate(requests)), [None] * len(requests)
    while pending:
        now = time.perf_counter() - start
        if pending[0][1][0] > now:
            time.sleep(pending[0][1][0] - now)
            continue
        batch = [r for r in pending if r[1][0] <= now][:max_batch]
        pending = pending[len(batch) :]
        new = max(r[1][2] for r in batch)
        jaxlm.generate(model, None, [r[1][1] for r in batch], max_new_tokens=new, stop_token_ids=[])
        end = time.perf_counter()
        for i, (arrival, _, n) in batch:
            out[i] = dict(arrival=start + arrival, times=[end] * n)
    return out


def summarize(runs: list[dict]) -> dict:
    first = min(r["arrival"] for r in runs)
    last = max(r["times"][-1] for r in runs)
    tokens = sum(len(r["times"]) for r in runs)
    ttft = [r["times"][0] - r["arrival"] for r in runs]
    tpot = [
        (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1)
        for r in runs
        if len(r["times"]) > 1
    ]
    itl = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:], strict=False)]

    def pct(values):
        return {f"p{q}": float(np.percentile(values, q)) if values else None for q in (50, 90, 99)}

    return dict(
        seconds=last - first,
        requests_per_s=len(runs) / (last - first),
        output_tokens_per_s=tokens / (last - first),
        ttft_s=pct(ttft),
        tpot_s=pct(tpot),
        itl_s=pct(itl),
    )


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second; inf: at once")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=_pair, default=(16, 128))
    p.add_argument("--output-len", type=_pair, default=(16, 128))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    model, _ = jaxlm.load(args.model, progress=False)
    requests = workload(
        args.requests, args.rate, args.prompt_len, args.output_len, model.config.vocab_size
    )
    longest = args.prompt_len[1] + args.output_len[1]
    pages = args.max_num_seqs * -(-longest // args.page_size) + 1
    results, load = {}, {}
    with jaxlm.LLMEngine(
        model,
        max_num_seqs=args.max_num_seqs,
        max_seq_len=longest,
        page_size=args.page_size,
        num_pages=pages,
    ) as engine:
        run_engine(engine, requests)
        with OtherLoad() as busy:
            results["LLMEngine"] = summarize(run_engine(engine, requests))
        load["LLMEngine"] = busy.cores
    run_static(model, requests, args.max_num_seqs)
    with OtherLoad() as busy:
        results["static generate"] = summarize(run_static(model, requests, args.max_num_seqs))
    load["static generate"] = busy.cores
    rows = []
    for name, r in results.items():
        rows.append(
            (
                name,
                f"{r['requests_per_s']:.2f}",
                f"{r['output_tokens_per_s']:.1f}",
                *(f"{1e3 * r['ttft_s'][q]:.0f}" for q in ("p50", "p90", "p99")),
                *(
                    "-" if r[k]["p50"] is None else f"{1e3 * r[k]['p50']:.1f}"
                    for k in ("tpot_s", "itl_s")
                ),
                f"{load[name]:.2f}",
            )
        )
    header = ("engine", "req/s", "out tok/s", "TTFT p50 ms", "p90", "p99", "TPOT p50 ms")
    header += ("ITL p50 ms", "load")
    print(
        f"{args.requests} requests at {args.rate} req/s, prompts {args.prompt_len}, "
        f"outputs {args.output_len}, {args.max_num_seqs} sequences at once"
    )
    print("\n".join(text_table(header, rows)))
    ours, static = results["LLMEngine"], results["static generate"]
    speed = ours["output_tokens_per_s"] / static["output_tokens_per_s"]
    ttft = ours["ttft_s"]["p50"] / static["ttft_s"]["p50"]
    print(f"LLMEngine / static: output tokens/s {speed:.2f}x, TTFT p50 {ttft:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(dict(results=results, load=load), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
