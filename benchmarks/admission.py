"""Admission: how fast `LLMEngine` starts many short prompts queued at once.

`--requests` prompts of `--prompt-len` random tokens, each asking for `--max-tokens` tokens
(1: the request ends at its first), are submitted at once and timed until all have finished,
twice on one engine: admitting one prompt per step (`max_prefill_chunks=1`, as the engine did
before a step ran several prompts' chunks) and several, as many as the step's shapes hold
within `max_num_batched_tokens`. Each runs once to warm up, then once measured; the figures
are seconds, requests per second, XLA calls and steps, side by side in the same process.

Usage: python benchmarks/admission.py [--model PATH] [--requests 1000] [--prompt-len 4,12]
    [--max-tokens 1] [--max-num-seqs 8] [--max-num-batched-tokens 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jaxlm
from jaxlm.bench import OtherLoad, text_table


def run(engine, prompts, max_tokens: int, one_per_step: bool) -> dict:
    engine.scheduler.max_prefill_chunks = 1 if one_per_step else None
    before = engine.stats()
    start = time.perf_counter()
    handles = [engine.submit(p, max_new_tokens=max_tokens, stop_token_ids=[]) for p in prompts]
    outputs = [h.result() for h in handles]
    seconds = time.perf_counter() - start
    after = engine.stats()
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    return dict(
        seconds=seconds,
        calls=after.calls - before.calls,
        steps=after.steps - before.steps,
        outputs=[o.token_ids for o in outputs],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prompt-len", default="4,12", help="lo,hi tokens")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = parser.parse_args()
    lo, hi = (int(v) for v in args.prompt_len.split(","))
    model, tokenizer = jaxlm.load(args.model, progress=False)
    rng = np.random.default_rng(0)
    lengths = rng.integers(lo, hi + 1, args.requests)
    prompts = [rng.integers(0, model.config.vocab_size, int(n)).tolist() for n in lengths]
    start = time.perf_counter()
    with jaxlm.LLMEngine(
        model,
        tokenizer,
        max_num_seqs=args.max_num_seqs,
        max_seq_len=hi + args.max_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # Distinct prompts: no step finds another's pages in the cache.
        prefix_cache=False,
    ) as engine:
        print(f"{len(engine.compiled)} step shapes compiled in {time.perf_counter() - start:.1f} s")
        results, rows = {}, []
        for name, one in (("one prompt per step", True), ("several per step", False)):
            run(engine, prompts[: 4 * args.max_num_seqs], args.max_tokens, one)
            with OtherLoad() as busy:
                results[name] = r = run(engine, prompts, args.max_tokens, one)
            rows.append(
                (
                    name,
                    f"{r['seconds']:.1f}",
                    f"{args.requests / r['seconds']:.1f}",
                    str(r["calls"]),
                    str(r["steps"]),
                    f"{busy.cores:.2f}",
                )
            )
    header = ("admission", "seconds", "req/s", "calls", "steps", "load")
    print("\n".join(text_table(header, rows)))
    one, several = results.values()
    same = sum(a == b for a, b in zip(one["outputs"], several["outputs"], strict=True))
    print(
        f"several / one per step: {one['seconds'] / several['seconds']:.2f}x faster; "
        f"{same} of {args.requests} outputs equal"
    )


if __name__ == "__main__":
    main()
