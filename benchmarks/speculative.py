"""Prompt-lookup drafts (`generate(..., speculative="ngram")`) against plain decoding, batch 1.

Each task is one chat prompt, answered greedily with and without drafts; the tokens must be the
same. Tasks whose answer repeats the prompt (a text copied out, a function given back with a
docstring) are where drafts pay; open-ended ones (a story, an explanation) are where they must
cost nothing. Per repeat, `generate` runs once with 1 new token and once with `--new-tokens`,
without drafts and then with; decode tok/s is the tokens after the first over the difference.
The table gives both rates (medians), their ratio, and the drafts proposed and kept.

Usage: python benchmarks/speculative.py [--model PATH] [--quantize int8] [--tasks A,B]
    [--new-tokens 128] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from jaxlm.bench import OtherLoad, text_table

TEXT = (
    "The lighthouse stood on a low island of black rock, two miles from the harbour. Every "
    "evening the keeper climbed the hundred and twelve steps, trimmed the wick, wound the "
    "clockwork that turned the lens, and wrote the weather in a brown book: the wind, the sea, "
    "the ships that passed. In winter the spray reached the gallery, and ice had to be broken "
    "from the windows before the light could be seen. The supply boat came on the first Monday "
    "of each month, when the sea allowed it, with oil, flour, letters and newspapers that were "
    "already old. The keeper read them all, slowly, one a day, so that they lasted until the "
    "boat came again."
)
CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""
TASKS = {
    "copy a text": f"Copy this text exactly, word for word:\n\n{TEXT}",
    "add a docstring": f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    "write a story": "Write a short story about a fox who learns to sail.",
    "explain": "Explain why the sky is blue to a ten-year-old.",
}


def _decode_rates(model, tokenizer, prompt, new_tokens, repeats):
    """Median decode tok/s without and with drafts, and the last result of each; the two
    alternate run by run, after runs that compile, so that drift falls on both alike."""
    import jaxlm

    ways = (None, "ngram")
    for how in ways:
        for n in (1, new_tokens):
            jaxlm.generate(model, tokenizer, prompt, max_new_tokens=n, speculative=how)
    rates = {how: [] for how in ways}
    outs = {}
    for _ in range(repeats):
        for how in ways:
            start = time.perf_counter()
            jaxlm.generate(model, tokenizer, prompt, max_new_tokens=1, speculative=how)
            t1 = time.perf_counter() - start
            start = time.perf_counter()
            outs[how] = jaxlm.generate(
                model, tokenizer, prompt, max_new_tokens=new_tokens, speculative=how
            )
            tn = time.perf_counter() - start
            rates[how].append((len(outs[how].token_ids[0]) - 1) / max(tn - t1, 1e-9))
    return [(statistics.median(rates[how]), outs[how]) for how in ways]


def main(argv: list[str] | None = None) -> int:
    import jaxlm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--quantize", default=None)
    p.add_argument("--tasks", default=",".join(TASKS), help="comma list of tasks to run")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    model, tokenizer = jaxlm.load(args.model, progress=False, quantize=args.quantize)
    rows, results, busy = [], [], 0.0
    for task in args.tasks.split(","):
        text = TASKS[task]
        ids = tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}]),
            add_special_tokens=False,
        )
        with OtherLoad() as load:
            (plain, base), (drafted, out) = _decode_rates(
                model, tokenizer, ids, args.new_tokens, args.repeats
            )
        busy = max(busy, load.cores)
        same = out.token_ids == base.token_ids
        result = dict(
            task=task,
            tokens=len(out.token_ids[0]),
            plain_tok_s=plain,
            ngram_tok_s=drafted,
            ratio=drafted / plain,
            drafted=out.drafted_tokens[0],
            accepted=out.accepted_tokens[0],
            same_tokens=same,
        )
        results.append(result)
        rows.append(
            (
                task,
                str(result["tokens"]),
                f"{plain:.1f}",
                f"{drafted:.1f}",
                f"{drafted / plain:.2f}x",
                f"{result['accepted']} / {result['drafted']}",
                "yes" if same else "NO",
            )
        )
    header = ("task", "tokens", "plain tok/s", "ngram tok/s", "ratio", "kept / drafted", "same")
    print("\n".join(text_table(header, rows)))
    print(f"load: {busy:.2f} cores kept busy by other processes (above 0.1: measure again)")
    if args.json is not None:
        args.json.write_text(json.dumps(dict(results=results, load=busy), indent=1))
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
