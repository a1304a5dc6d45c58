"""Prompt-lookup drafts (`speculative="ngram"`) against plain decoding, in `generate` at batch 1
or in an `LLMEngine`; with `--draft-model`, a draft model's drafts instead.

Each task is one chat prompt, answered greedily with and without drafts; the tokens must be the
same. Tasks whose answer repeats the prompt (a text copied out, a function given back with a
docstring) are where drafts pay; open-ended ones (a story, an explanation) are where they must
cost nothing. Per repeat, `generate` runs once with 1 new token and once with `--new-tokens`,
without drafts and then with; decode tok/s is the tokens after the first over the difference.
The table gives both rates (medians), their ratio, and the drafts proposed and kept.
`--draft-model PATH` drafts with the model at PATH (`same`: `--model` again) instead, its
weights stored as `--draft-quantize` says (int8: a cheaper copy of the same model).

With `--engine`, one `LLMEngine(speculative="ngram")` (or `speculative=` the draft model) of
`--max-num-seqs` slots serves each task alone and then every task `--copies` times at once (a
mixed load), each request with drafts and without (`submit(..., speculative=None)`),
alternated; tok/s is the tokens after each request's first over the time from the first of them
to the last.

With `--vs llama.cpp`, the same loads as `--engine` also go to llama.cpp's `llama-server` on the
same GGUF file, `--max-num-seqs` slots, started once without drafts and once with
`--spec-type` `--llama-spec-type` (its prompt lookup, `ngram-simple`, unless given), streamed
over HTTP, greedy; tok/s as the engine's, from the times the chunks arrive, and the drafts from
the `timings` llama.cpp sends with each answer. Its tokens are its own (the file's 4-bit
weights), so the table says whether its two runs agree with each other.

Usage: python benchmarks/speculative.py [--model PATH] [--quantize int8] [--tasks A,B]
    [--new-tokens 128] [--repeats 5] [--num-speculative-tokens 3] [--json PATH]
    [--draft-model PATH|same [--draft-quantize int8]]
    [--engine [--max-num-seqs 8] [--copies 8] [--max-num-batched-tokens 256]]
    [--vs llama.cpp [--llama-server PATH] [--llama-spec-type ngram-simple]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import http_client

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


def _asked(how, drafts) -> dict:
    """`generate`'s drafting arguments: none, or `how` with `drafts` tokens a step."""
    return {} if how is None else dict(speculative=how, num_speculative_tokens=drafts)


def _decode_rates(model, tokenizer, prompt, new_tokens, repeats, drafts, drafter):
    """Median decode tok/s without and with drafts (`drafter`: `"ngram"` or a draft model), and
    the last result of each; the two alternate run by run, after runs that compile, so that
    drift falls on both alike."""
    import jaxlm

    ways = (None, drafter)
    for how in ways:
        for n in (1, new_tokens):
            jaxlm.generate(model, tokenizer, prompt, max_new_tokens=n, **_asked(how, drafts))
    rates = {how: [] for how in ways}
    outs = {}
    for _ in range(repeats):
        for how in ways:
            asked = _asked(how, drafts)
            start = time.perf_counter()
            jaxlm.generate(model, tokenizer, prompt, max_new_tokens=1, **asked)
            t1 = time.perf_counter() - start
            start = time.perf_counter()
            outs[how] = jaxlm.generate(model, tokenizer, prompt, max_new_tokens=new_tokens, **asked)
            tn = time.perf_counter() - start
            rates[how].append((len(outs[how][0].token_ids) - 1) / max(tn - t1, 1e-9))
    return [(statistics.median(rates[how]), outs[how]) for how in ways]


def _result(task, tokens, plain, drafted, kept, made, same) -> dict:
    """A row of the table: tok/s without drafts and with them, the drafts kept of those made,
    and whether the two ways gave the same output."""
    return dict(
        task=task,
        tokens=tokens,
        plain_tok_s=plain,
        drafted_tok_s=drafted,
        ratio=drafted / plain,
        drafted=made,
        accepted=kept,
        same_tokens=same,
    )


def _generate_result(model, tokenizer, task, ids, args, drafter) -> dict:
    (plain, base), (drafted, out) = _decode_rates(
        model, tokenizer, ids, args.new_tokens, args.repeats, args.num_speculative_tokens, drafter
    )
    kept, made = out[0].accepted_tokens, out[0].drafted_tokens
    same = out[0].token_ids == base[0].token_ids
    return _result(task, len(out[0].token_ids), plain, drafted, kept, made, same)


def _engine_rates(engine, prompts, new_tokens, repeats):
    """`_decode_rates` through `engine`: all `prompts` at once, tok/s from the first token of
    any to the last, and the drafts kept / proposed of the last run with drafts (the engine's
    own way)."""
    ways = (None, "engine")

    def run(how):
        handles = [engine.submit(p, max_new_tokens=new_tokens, speculative=how) for p in prompts]
        outs = [h.result() for h in handles]
        first = min(h.token_times[0] for h in handles)
        last = max(h.token_times[-1] for h in handles)
        return sum(len(o.token_ids) - 1 for o in outs) / max(last - first, 1e-9), outs

    for how in ways:
        run(how)
    rates, outs, counts = {how: [] for how in ways}, {}, (0, 0)
    for _ in range(repeats):
        for how in ways:
            before = engine.stats()
            rate, outs[how] = run(how)
            rates[how].append(rate)
            after = engine.stats()
            if how is not None:
                counts = (
                    after.accepted_tokens - before.accepted_tokens,
                    after.drafted_tokens - before.drafted_tokens,
                )
    same = [o.token_ids for o in outs[None]] == [o.token_ids for o in outs["engine"]]
    tokens = sum(len(o.token_ids) for o in outs["engine"])
    return statistics.median(rates[None]), statistics.median(rates["engine"]), same, tokens, counts


def _loads(args, prompts) -> dict:
    """Each task's prompt alone, then every task `--copies` times at once."""
    loads = {f"{task} (alone)": [ids] for task, ids in prompts.items()}
    loads[f"all tasks x{args.copies}, {args.max_num_seqs} slots"] = [
        ids for _ in range(args.copies) for ids in prompts.values()
    ]
    return loads


def _engine_main(args, model, tokenizer, prompts, drafter) -> list[dict]:
    import jaxlm

    longest = max(len(p) for p in prompts.values()) + args.new_tokens
    sizes = dict(max_num_seqs=args.max_num_seqs, max_seq_len=longest, page_size=16)
    sizes["max_num_batched_tokens"] = args.max_num_batched_tokens
    loads = _loads(args, prompts)
    results = []
    drafts = args.num_speculative_tokens
    with jaxlm.LLMEngine(
        model, tokenizer, speculative=drafter, num_speculative_tokens=drafts, **sizes
    ) as engine:
        for name, load in loads.items():
            plain, drafted, same, tokens, (kept, made) = _engine_rates(
                engine, load, args.new_tokens, args.repeats
            )
            results.append(_result(name, tokens, plain, drafted, kept, made, same))
    return results


def _llama_cpp_rate(url: str, body: dict, prompts, new_tokens: int):
    """One load streamed to llama.cpp at once: tok/s as `_engine_rates` counts them, each
    answer's text, the tokens of all, and the drafts kept and proposed (its `timings`)."""
    runs = http_client.run_http(url, body, [(0.0, p, new_tokens) for p in prompts], prompts)
    first = min(r["times"][0] for r in runs)
    last = max(r["times"][-1] for r in runs)
    rate = sum(r["tokens"] - 1 for r in runs) / max(last - first, 1e-9)
    timings = [r["timings"] or {} for r in runs]
    kept = sum(t.get("draft_n_accepted", 0) for t in timings)
    made = sum(t.get("draft_n", 0) for t in timings)
    return rate, [r["text"] for r in runs], sum(r["tokens"] for r in runs), (kept, made)


def _llama_cpp_main(args, prompts) -> tuple[list[dict], str | None]:
    """The loads of `--engine` through `llama-server` without drafts and with them; the rows,
    or none and why."""
    from jaxlm.loading import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    binary, why = http_client.llama_server_binary(args.llama_server, path)
    if binary is None:
        return [], why
    longest = max(len(p) for p in prompts.values()) + args.new_tokens
    loads = _loads(args, prompts)
    measured = {}  # way -> load -> (rates, texts, counts)
    for how in (None, args.llama_spec_type):
        server = http_client.llama_server(
            binary, path, http_client.free_port(), args.max_num_seqs, longest, how
        )
        with server:
            url = server.url + "/v1"
            body = dict(stream=True, temperature=0, stream_options={"include_usage": True})
            measured[how] = {}
            for name, load in loads.items():
                _llama_cpp_rate(url, body, load, args.new_tokens)
                runs = [
                    _llama_cpp_rate(url, body, load, args.new_tokens) for _ in range(args.repeats)
                ]
                rate = statistics.median(r[0] for r in runs)
                measured[how][name] = (rate, *runs[-1][1:])
    rows = []
    for name in loads:
        plain, texts, _, _ = measured[None][name]
        drafted, drafted_texts, tokens, (kept, made) = measured[args.llama_spec_type][name]
        rows.append(_result(name, tokens, plain, drafted, kept, made, texts == drafted_texts))
    return rows, None


def _print_table(results, way: str) -> None:
    rows = [
        (
            r["task"],
            str(r["tokens"]),
            f"{r['plain_tok_s']:.1f}",
            f"{r['drafted_tok_s']:.1f}",
            f"{r['ratio']:.2f}x",
            f"{r['accepted']} / {r['drafted']}",
            "yes" if r["same_tokens"] else "NO",
        )
        for r in results
    ]
    header = ("task", "tokens", "plain tok/s", f"{way} tok/s", "ratio", "kept / drafted", "same")
    print("\n".join(text_table(header, rows)))


def main(argv: list[str] | None = None) -> int:
    import jaxlm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--quantize", default=None)
    p.add_argument("--tasks", default=",".join(TASKS), help="comma list of tasks to run")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="drafts a step (default 3)"
    )
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    p.add_argument("--engine", action="store_true", help="through an LLMEngine, not generate")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the engine's slots")
    p.add_argument("--copies", type=int, default=8, help="each task's requests in the mixed load")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="the engine's step")
    p.add_argument(
        "--draft-model", default=None, help="draft with this model (`same`: `--model` again)"
    )
    p.add_argument("--draft-quantize", default=None, help="the draft model's weights: int8")
    p.add_argument("--vs", action="append", default=[], choices=["llama.cpp"])
    p.add_argument("--llama-server", default=None, help="llama.cpp's server binary")
    p.add_argument(
        "--llama-spec-type", default="ngram-simple", help="llama-server's `--spec-type` drafts"
    )
    args = p.parse_args(argv)
    model, tokenizer = jaxlm.load(args.model, progress=False, quantize=args.quantize)
    drafter, way = "ngram", "ngram"
    if args.draft_model:
        path = args.model if args.draft_model == "same" else args.draft_model
        drafter, _ = jaxlm.load(path, progress=False, quantize=args.draft_quantize)
        way = f"draft model ({args.draft_model}, {args.draft_quantize or 'as stored'})"
    prompts = {
        task: tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": TASKS[task]}]),
            add_special_tokens=False,
        )
        for task in args.tasks.split(",")
    }
    with OtherLoad() as load:
        if args.engine:
            results = _engine_main(args, model, tokenizer, prompts, drafter)
        else:
            results = [
                _generate_result(model, tokenizer, t, p, args, drafter) for t, p in prompts.items()
            ]
    busy = load.cores
    _print_table(results, way)
    print(f"load: {busy:.2f} cores kept busy by other processes (above 0.1: measure again)")
    report = dict(results=results, load=busy, drafts=way)
    if "llama.cpp" in args.vs:
        report["llama.cpp"], skipped = _llama_cpp_main(args, prompts)
        report["skipped"] = {"llama.cpp": skipped} if skipped else {}
        if skipped:
            print(f"llama.cpp skipped: {skipped}")
        else:
            print(f"\nllama.cpp's llama-server, --spec-type {args.llama_spec_type}:")
            _print_table(report["llama.cpp"], args.llama_spec_type)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
