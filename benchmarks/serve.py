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

With `--speculative ngram`, the engine (local, or `jaxlm serve`) drafts tokens from each
request's own text, and `llama-server` with `--vs llama.cpp` its own way (`--spec-type
ngram-simple`); the random prompts here never repeat, so this measures what drafting costs
where it finds nothing (`benchmarks/speculative.py --engine` measures where it pays).

With `--constrained`, the engine serves the stream once more with every request held to a JSON
schema (`llguidance`'s token masks, one decode step per call): output tokens/s of both in the
same run, and the host's time filling a mask per constrained token.

Over HTTP (`--url`, `--vs llama.cpp`), the same requests go to OpenAI-compatible servers as
streamed `/v1/completions` (greedy, `max_tokens` = the output length, `ignore_eos`), the prompts
as token-id lists where the server takes them (else as the tokenizer's text), and the figures
are a client's: TTFT from sending to the first chunk with a token, ITL the gaps between chunks.
A warm-up on other prompts keeps the measured ones out of a server's prompt cache within a run,
not across runs: give `--url` a server started afresh for each run (`--vs llama.cpp` starts its
`llama-server` anew every time).

Usage: python benchmarks/serve.py [--model PATH] [--requests 32] [--rate 4] [--max-num-seqs 8]
    [--prompt-len 16,128] [--output-len 16,128] [--max-seq-len N] [--max-num-batched-tokens 256]
    [--json PATH] [--constrained] [--speculative ngram]
    [--url http://127.0.0.1:8000/v1] [--vs llama.cpp [--llama-server PATH]]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import http_client
import numpy as np

import jaxlm
from jaxlm.bench import OtherLoad, text_table
from jaxlm.config import ModelConfig
from jaxlm.constrain import Grammar
from jaxlm.loading import default_model_path, open_checkpoint


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


# Records without end: a constrained request runs its whole output length, as the others do.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "minItems": 100_000,
}


def run_engine(engine, requests, response_format=None) -> list[dict]:
    start = time.perf_counter()
    handles = [None] * len(requests)

    def feed():
        for i, (arrival, prompt, new) in enumerate(requests):
            time.sleep(max(0.0, start + arrival - time.perf_counter()))
            handles[i] = engine.submit(
                prompt, max_new_tokens=new, stop_token_ids=[], response_format=response_format
            )

    feeder = threading.Thread(target=feed)
    feeder.start()
    feeder.join()
    out = []
    for (arrival, _, new), handle in zip(requests, handles, strict=True):
        result = handle.result()
        assert len(result.token_ids) == new
        out.append(dict(arrival=start + arrival, times=list(handle.token_times), tokens=new))
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
            out[i] = dict(arrival=start + arrival, times=[end] * n, tokens=n)
    return out


def summarize(runs: list[dict]) -> dict:
    """The figures of one run: each request's `arrival`, the `times` its tokens (over HTTP:
    its chunks) came, and its count of `tokens`."""
    first = min(r["arrival"] for r in runs)
    last = max(r["times"][-1] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    ttft = [r["times"][0] - r["arrival"] for r in runs]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in runs if r["tokens"] > 1]
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


def table(results: dict, load: dict, server_cores: dict | None = None) -> list[str]:
    """The lines of the figures' table; over HTTP, with the cores each server kept busy."""
    rows = []
    for name, r in results.items():
        row = (
            name,
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            *(f"{1e3 * r['ttft_s'][q]:.0f}" for q in ("p50", "p90", "p99")),
            *(
                "-" if r[k]["p50"] is None else f"{1e3 * r[k]['p50']:.1f}"
                for k in ("tpot_s", "itl_s")
            ),
        )
        if server_cores is not None:
            row += (_figure(server_cores[name]),)
        rows.append((*row, _figure(load[name])))
    header = ("engine", "req/s", "out tok/s", "TTFT p50 ms", "p90", "p99", "TPOT p50 ms")
    header += ("ITL p50 ms",) + (("server cores",) if server_cores is not None else ()) + ("load",)
    return text_table(header, rows)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run_local(args, requests) -> dict:
    """`LLMEngine` and static `generate` in this process."""
    model, tokenizer = jaxlm.load(args.model, progress=False)
    longest = args.prompt_len[1] + args.output_len[1]
    results, load = {}, {}
    with jaxlm.LLMEngine(
        model,
        tokenizer,
        max_num_seqs=args.max_num_seqs,
        max_seq_len=args.max_seq_len or longest,
        page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative=args.speculative,
    ) as engine:
        run_engine(engine, requests)
        with OtherLoad() as busy:
            results["LLMEngine"] = summarize(run_engine(engine, requests))
        load["LLMEngine"] = busy.cores
        if args.constrained:
            name, grammar = "LLMEngine, JSON schema", Grammar.json(SCHEMA)
            run_engine(engine, requests, grammar)
            before = engine.stats()
            with OtherLoad() as busy:
                results[name] = summarize(run_engine(engine, requests, grammar))
            load[name] = busy.cores
            after = engine.stats()
            masks = after.grammar_masks - before.grammar_masks
            mask_ms = 1e3 * (after.grammar_mask_seconds - before.grammar_mask_seconds) / masks
            results[name]["mask_ms_per_token"] = mask_ms
    run_static(model, requests, args.max_num_seqs)
    with OtherLoad() as busy:
        results["static generate"] = summarize(run_static(model, requests, args.max_num_seqs))
    load["static generate"] = busy.cores
    print("\n".join(table(results, load)))
    ours, static = results["LLMEngine"], results["static generate"]
    speed = ours["output_tokens_per_s"] / static["output_tokens_per_s"]
    ttft = ours["ttft_s"]["p50"] / static["ttft_s"]["p50"]
    print(f"LLMEngine / static: output tokens/s {speed:.2f}x, TTFT p50 {ttft:.2f}x")
    if args.constrained:
        constrained = results["LLMEngine, JSON schema"]
        speed = constrained["output_tokens_per_s"] / ours["output_tokens_per_s"]
        print(
            f"JSON schema / unconstrained: output tokens/s {speed:.2f}x; the host filled a mask "
            f"in {constrained['mask_ms_per_token']:.3f} ms per constrained token"
        )
    return dict(results=results, load=load)


def measure_server(url: str, requests, warmup, tokenizer, server=None) -> dict:
    """The workload streamed to the server at `url`, after a warm-up on other prompts, so that
    the measured ones find nothing in a prompt cache. `load` is the other processes' cores less
    the server's, so it is known only for a server this started (`server`)."""
    body = http_client.request_body(url)
    ids = http_client.takes_token_ids(url, body, warmup[0][1])
    if not ids and tokenizer is None:
        raise SystemExit(f"{url} takes no token ids and the model has no tokenizer for text")

    def prompts(reqs):
        return [p if ids else tokenizer.decode(p) for _, p, _ in reqs]

    http_client.run_http(url, body, warmup, prompts(warmup))
    cpu = server.cpu_seconds() if server is not None else None
    with OtherLoad() as busy:
        start = time.perf_counter()
        runs = http_client.run_http(url, body, requests, prompts(requests))
        wall = time.perf_counter() - start
    server_cores = None if server is None else (server.cpu_seconds() - cpu) / wall
    load = None if server is None else max(0.0, busy.cores - server_cores)
    per_request = [
        dict(
            ttft_s=r["times"][0] - r["arrival"],
            chunks=len(r["times"]),
            output_tokens=r["tokens"],
            requested_tokens=r["requested"],
            finish_reason=r["finish_reason"],
        )
        for r in runs
    ]
    return dict(
        summary=summarize(runs),
        load=load,
        server_cores=server_cores,
        prompts="token ids" if ids else "text",
        requests=per_request,
        command=None if server is None else server.command,
    )


def run_servers(args, requests, vocab: int, tokenizer) -> dict:
    """The workload over HTTP: at `--url`, or at a `jaxlm serve` this starts, and with
    `--vs llama.cpp` at a `llama-server` this starts on the same file, one after the other."""
    path = Path(args.model) if args.model else default_model_path()
    longest = args.prompt_len[1] + args.output_len[1]
    warmup = workload(args.max_num_seqs, np.inf, args.prompt_len, args.output_len, vocab, seed=1)
    targets, skipped = {}, {}
    if args.url is not None:
        targets[args.url] = args.url.rstrip("/")
    else:
        port = http_client.free_port()
        targets["jaxlm serve"] = http_client.jaxlm_server(
            args.model, port, args.max_num_seqs, longest, args.page_size, args.speculative
        )
    if "llama.cpp" in args.vs:
        binary, why = http_client.llama_server_binary(args.llama_server, path)
        if binary is None:
            skipped["llama.cpp"] = why
        else:
            port = http_client.free_port()
            spec_type = "ngram-simple" if args.speculative else None
            targets["llama.cpp"] = http_client.llama_server(
                binary, path, port, args.max_num_seqs, longest, spec_type
            )
    measured = {}
    for name, target in targets.items():
        if isinstance(target, str):
            measured[name] = measure_server(target, requests, warmup, tokenizer)
            continue
        with target:
            url = target.url + "/v1"
            measured[name] = measure_server(url, requests, warmup, tokenizer, target)
    results = {name: m.pop("summary") for name, m in measured.items()}
    load = {name: m["load"] for name, m in measured.items()}
    print("\n".join(table(results, load, {n: m["server_cores"] for n, m in measured.items()})))
    for name, m in measured.items():
        short = sum(r["output_tokens"] < r["requested_tokens"] for r in m["requests"])
        if short:
            print(f"{name}: {short} requests stopped early (at an end-of-sequence token)")
    for name, note in skipped.items():
        print(f"{name} skipped: {note}")
    if len(results) == 2:
        (a, ours), (b, other) = results.items()
        speed = ours["output_tokens_per_s"] / other["output_tokens_per_s"]
        ttft = ours["ttft_s"]["p50"] / other["ttft_s"]["p50"]
        print(f"{a} / {b}: output tokens/s {speed:.2f}x, TTFT p50 {ttft:.2f}x")
    return dict(results=results, load=load, servers=measured, skipped=skipped)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second; inf: at once")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=_pair, default=(16, 128))
    p.add_argument("--output-len", type=_pair, default=(16, 128))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="the engine's longest request (default: the longest of the workload); the pages "
        "hold every sequence at that length",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="the most tokens a step of the engine runs, as `jaxlm serve`'s option: each prompt "
        "chunk width up to it is compiled",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    p.add_argument(
        "--constrained",
        action="store_true",
        help="serve the stream again with every request held to a JSON schema",
    )
    p.add_argument("--speculative", choices=["ngram"], default=None, help="engine drafts")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server's base URL (.../v1)")
    p.add_argument("--vs", action="append", default=[], choices=["llama.cpp"])
    p.add_argument("--llama-server", default=None, help="llama.cpp's server binary")
    args = p.parse_args(argv)
    longest = args.prompt_len[1] + args.output_len[1]
    if args.max_seq_len is not None and args.max_seq_len < longest:
        p.error(f"`--max-seq-len` {args.max_seq_len} is below the workload's longest, {longest}")
    checkpoint = open_checkpoint(args.model or default_model_path())
    vocab = ModelConfig.from_hf_config(checkpoint.config).vocab_size
    requests = workload(args.requests, args.rate, args.prompt_len, args.output_len, vocab)
    print(
        f"{args.requests} requests at {args.rate} req/s, prompts {args.prompt_len}, "
        f"outputs {args.output_len}, {args.max_num_seqs} sequences at once"
    )
    if args.url is None and not args.vs:
        report = run_local(args, requests)
    else:
        report = run_servers(args, requests, vocab, checkpoint.tokenizer)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
