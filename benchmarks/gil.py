"""Generation throughput beside a busy pure-Python thread: who holds the GIL.

Four workloads generate greedy tokens from the same weights:
- `generate`: `jaxlm.generate`, one XLA call per request (prefill and the whole decode loop);
- `python loop`: `plan.prefill`, then `plan.decode` in a Python `for` loop with the argmax taken
  on the host after every step;
- `engine`: a `jaxlm.LLMEngine` serving a stream of requests of several lengths, more than it
  has rows, so that requests join the running batch as others leave; its own thread schedules
  and runs one XLA call per step with a prompt chunk, and one per `--decode-steps` steps of
  decode tokens alone;
- `transformers`: transformers' `generate` on a `LlamaForCausalLM` holding the same weights.

Each runs alone and then beside a thread spinning `n += 1`, which holds the GIL whenever it can.
The table gives each workload's tokens/s beside the thread over alone, and the thread's
iterations/s alone and beside each workload. On a machine with two or more cores, XLA's threads
are pinned to core 0 and the busy thread to core 1, so the two compete for the GIL only, not
for a core: the process's affinity is set to {0} before JAX creates its CPU client (XLA sizes
its thread pools from it and its threads keep it), and the main thread gets every core back
before measuring. The engine's thread starts while the process is pinned, so it stays on core 0
beside XLA's; the main thread only submits requests and waits for them. transformers runs on
one torch thread pinned to core 0 as well.

Each time a thread waits for XLA it gives up the GIL, and takes it back only when the busy
thread is made to drop it, after the switch interval (`sys.setswitchinterval`, 5 ms unless
set): `--switch-interval` sets it for the whole run.

Usage: python benchmarks/gil.py [--model PATH] [--new-tokens 64] [--seconds 2] [--repeats 3]
       [--decode-steps 4] [--switch-interval 0.0005]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from jaxlm.bench import OtherLoad

XLA_CPU = 0
BUSY_CPU = 1
# The engine workload: rows of its batch, and requests per round (twice the rows, so that some
# wait and join the batch as others finish).
ENGINE_SEQS = 4
ENGINE_REQUESTS = 8


def thread_affinities() -> dict[str, int]:
    """How many of this process's threads may run on each CPU list, e.g. `{"0": 14, "0-1": 2}`."""
    out: dict[str, int] = {}
    for path in glob.glob("/proc/self/task/*/status"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f:
                if line.startswith("Cpus_allowed_list"):
                    cpus = line.split()[1]
                    out[cpus] = out.get(cpus, 0) + 1
    return out


class BusyThread:
    """A thread counting `n += 1` in pure Python until stopped, pinned to `cpu` if given."""

    def __init__(self, cpu: int | None):
        self.cpu = cpu
        self.count = 0
        self.cpu_seconds = 0.0
        self.seconds = 0.0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if self.cpu is not None:
            # On Linux, pid 0 is the calling thread: this pins this thread only.
            os.sched_setaffinity(0, {self.cpu})
        n = 0
        start, cpu0 = time.perf_counter(), time.thread_time()
        while not self._stop:
            n += 1
        self.seconds = time.perf_counter() - start
        self.cpu_seconds = time.thread_time() - cpu0
        self.count = n

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()

    @property
    def rate(self) -> float:
        """Iterations per second of wall time."""
        return self.count / self.seconds if self.seconds else 0.0


def busy_alone(seconds: float, cpu: int | None) -> float:
    """Iterations/s of the busy thread with nothing else running."""
    with BusyThread(cpu) as busy:
        time.sleep(seconds)
    return busy.rate


def run_for(workload, seconds: float) -> tuple[float, int]:
    """Run `workload()`, which returns the tokens it made, until `seconds` have passed.

    Returns the seconds it ran and the tokens made.
    """
    tokens = 0
    start = time.perf_counter()
    while True:
        tokens += workload()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed, tokens


@contextlib.contextmanager
def main_thread_on(cpus):
    """Run the calling thread on `cpus` (None: leave it) for the duration."""
    if cpus is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def make_workloads(
    model,
    prompt: list[int],
    new_tokens: int,
    transformers: bool,
    stack: contextlib.ExitStack,
    decode_steps: int = 4,
) -> dict:
    """The workloads by name: a function generating greedy tokens for `prompt` (`new_tokens` of
    them, or a round of requests of up to as many for the engine) that returns how many it made,
    and the CPUs its calling thread should run on when pinned (None: any). The engine closes
    with `stack`.
    """
    import jax

    import jaxlm
    from jaxlm.plans import MIN_NEW_TOKENS_BUCKET, MIN_PROMPT_BUCKET, bucket

    p = bucket(len(prompt), MIN_PROMPT_BUCKET)
    plan = jaxlm.plan(
        model,
        max_batch=1,
        max_seq_len=p + bucket(new_tokens, MIN_NEW_TOKENS_BUCKET),
        prefill_chunk=p,
    )
    padded = np.zeros((1, p), np.int32)
    padded[0, p - len(prompt) :] = prompt
    lengths = np.array([len(prompt)], np.int32)

    def generate() -> int:
        out = jaxlm.generate(
            model, None, prompt, max_new_tokens=new_tokens, stop_token_ids=[], plan=plan
        )
        return len(out[0].token_ids)

    def python_loop() -> int:
        scratch, logits = plan.prefill(plan.take(), padded, lengths)
        token = np.asarray(logits).argmax(-1)
        for _ in range(new_tokens - 1):
            scratch, logits = plan.decode(scratch, token)
            token = np.asarray(logits).argmax(-1)
        jax.block_until_ready(scratch)
        plan.keep(scratch)
        return new_tokens

    # The same prompt with outputs of four lengths, pages for every row, a step wide enough for
    # a whole prompt beside the decode tokens; no prefix cache, so that every round computes
    # the same.
    seq_len = len(prompt) + new_tokens
    engine = stack.enter_context(
        jaxlm.LLMEngine(
            model,
            max_num_seqs=ENGINE_SEQS,
            max_seq_len=seq_len,
            page_size=16,
            num_pages=ENGINE_SEQS * -(-seq_len // 16) + 1,
            max_num_batched_tokens=2 * bucket(len(prompt), 16),
            prefix_cache=False,
            decode_steps=decode_steps,
        )
    )
    lengths_new = [max(1, new_tokens * (4 - i % 4) // 4) for i in range(ENGINE_REQUESTS)]

    def serve() -> int:
        handles = [engine.submit(prompt, max_new_tokens=n, stop_token_ids=[]) for n in lengths_new]
        return sum(len(h.result().token_ids) for h in handles)

    workloads = {
        "generate": (generate, None),
        "python loop": (python_loop, None),
        "engine": (serve, None),
    }
    if transformers:
        import torch

        from jaxlm.bench import to_transformers

        torch.set_num_threads(1)
        hf = to_transformers(model)
        ids = torch.tensor([prompt])

        def hf_generate() -> int:
            with torch.inference_mode():
                hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            return new_tokens

        workloads["transformers"] = (hf_generate, {XLA_CPU})
    # A first run of each compiles what the plan did not (the prefill and decode steps).
    for fn, _ in workloads.values():
        fn()
    return workloads


def measure(workloads: dict, seconds: float, repeats: int, pinned: bool) -> dict:
    """Tokens/s of each workload alone and beside the busy thread, interleaved over repeats."""
    busy_cpu = BUSY_CPU if pinned else None
    samples: dict = {"busy alone": []}
    for name in workloads:
        samples[name] = {"alone": [], "beside": [], "busy": [], "busy_cpu_share": []}
    loads = []
    for _ in range(repeats):
        with OtherLoad() as load:
            samples["busy alone"].append(busy_alone(seconds, busy_cpu))
            for name, (fn, cpus) in workloads.items():
                pin = cpus if pinned else None
                with main_thread_on(pin):
                    elapsed, tokens = run_for(fn, seconds)
                    samples[name]["alone"].append(tokens / elapsed)
                    with BusyThread(busy_cpu) as busy:
                        elapsed, tokens = run_for(fn, seconds)
                samples[name]["beside"].append(tokens / elapsed)
                samples[name]["busy"].append(busy.rate)
                samples[name]["busy_cpu_share"].append(busy.cpu_seconds / busy.seconds)
        loads.append(load.cores)
    busy = statistics.median(samples["busy alone"])
    out = {
        "busy_alone_it_s": busy,
        "busy_alone_samples": samples["busy alone"],
        "other_load_cores": loads,
        "workloads": {},
    }
    for name in workloads:
        s = samples[name]
        ratios = [b / a for a, b in zip(s["alone"], s["beside"], strict=True)]
        out["workloads"][name] = {
            "alone_tok_s": statistics.median(s["alone"]),
            "beside_tok_s": statistics.median(s["beside"]),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "busy_beside_it_s": statistics.median(s["busy"]),
            "busy_ratio": statistics.median(s["busy"]) / busy if busy else None,
            "busy_cpu_share": statistics.median(s["busy_cpu_share"]),
            "samples": s,
        }
    return out


def format_table(results: dict) -> str:
    """The measurements as a text table."""
    header = (
        "workload",
        "alone tok/s",
        "beside busy tok/s",
        "ratio",
        "busy it/s beside",
        "busy beside/alone",
    )
    rows = [
        (
            name,
            f"{w['alone_tok_s']:.1f}",
            f"{w['beside_tok_s']:.1f}",
            f"{w['ratio']:.2f}",
            f"{w['busy_beside_it_s'] / 1e6:.1f}M",
            f"{w['busy_ratio']:.2f}",
        )
        for name, w in results["workloads"].items()
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [
        f"pinned: {results['pinned']} (XLA threads by CPU list: {results['thread_affinities']}); "
        f"busy thread alone {results['busy_alone_it_s'] / 1e6:.1f}M it/s; "
        f"GIL switch interval {results['switch_interval'] * 1e3:g} ms; the engine's decode "
        f"steps per call {results['decode_steps']}; "
        f"medians of {results['repeats']} repeats of {results['seconds']:g} s; cores busy with "
        "other processes during each repeat: "
        + ", ".join(f"{c:.2f}" for c in results["other_load_cores"]),
        "",
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("ratio: tokens/s beside the busy thread over tokens/s alone (1.00: not slowed)")
    return "\n".join(lines)


def run(
    model_path: str | None,
    *,
    prompt_len: int = 32,
    new_tokens: int = 64,
    seconds: float = 2.0,
    repeats: int = 3,
    transformers: bool = True,
    pinned: set[int] | None = None,
    decode_steps: int = 4,
) -> dict:
    """Load the model, build the workloads and measure them; returns the results.

    `pinned` gives the CPUs to return to the main thread before measuring, when the process was
    pinned to core 0 before JAX created its client (see `main`); the busy thread then takes
    core 1.
    """
    import jaxlm

    model, _ = jaxlm.load(model_path, progress=False)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, prompt_len).tolist()
    with contextlib.ExitStack() as stack:
        workloads = make_workloads(model, prompt, new_tokens, transformers, stack, decode_steps)
        if pinned:
            # Loading and compiling ran pinned, so every XLA thread (and the engine's) started
            # on core 0; the main thread now gets every core back and the busy thread takes 1.
            os.sched_setaffinity(0, pinned)
        results = measure(workloads, seconds, repeats, pinned is not None)
        affinities = thread_affinities()
    results.update(
        pinned=pinned is not None,
        thread_affinities=affinities,
        repeats=repeats,
        seconds=seconds,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        decode_steps=decode_steps,
        switch_interval=sys.getswitchinterval(),
    )
    return results


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table, with XLA pinned to core 0 on two or more cores."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip transformers")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    p.add_argument("--no-pin", action="store_true", help="leave XLA and the busy thread unpinned")
    p.add_argument("--decode-steps", type=int, default=4, help="the engine's decode steps per call")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="seconds: `sys.setswitchinterval` before measuring (default: Python's, 0.005)",
    )
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    pinned = None
    cpus = os.sched_getaffinity(0)
    # XLA sizes its thread pools from the affinity mask when it creates its CPU client, which
    # nothing has done yet when this file runs as a script.
    if not args.no_pin and len(cpus) >= 2:
        os.sched_setaffinity(0, {XLA_CPU})
        pinned = cpus
    results = run(
        args.model,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        seconds=args.seconds,
        repeats=args.repeats,
        transformers=not args.no_transformers,
        pinned=pinned,
        decode_steps=args.decode_steps,
    )
    print(format_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
