"""One process of `tests/test_multihost.py` (pytest does not collect this file).

    python multihost_worker.py MODEL_DIR OUT_FILE PROCESSES PROCESS_ID PORT

With `PROCESSES=2`, the process joins the others through `jax.distributed.initialize` on
`127.0.0.1:PORT` (CPU collectives over gloo); with `PROCESSES=1`, it is the single-host
reference, run with all the devices in one process, and it also generates on one device
without a mesh. On each mesh of `LAYOUTS` it plans, generates and streams, and writes what it
saw to `OUT_FILE`, as JSON renamed into place once complete. A process of a multi-process run
then generates until it fails: the test kills the other process meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax

import jaxlm

# Each layout's `(data, model)` mesh over the devices in `jax.devices()` order: process 0's
# first, so the first puts the batch across the processes and the model axis inside each,
# and the second puts the model axis across both (its collectives go from process to process).
LAYOUTS = {"data across processes": (2, 3), "model across processes": (1, 6)}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "café naïve"]
MAX_NEW_TOKENS = 12
MAX_SEQ_LEN = 512
PREFILL_CHUNK = 16
STREAM_CHUNK = 5
# Seconds without heartbeats after which JAX's coordination service declares a process dead.
HEARTBEAT_TIMEOUT = 10
# The engine's sizes and requests, on every layout (its slots split over `data`): more requests
# than slots, so that some join while others run, and prompts of several chunks. `jaxlm serve`
# runs on the layout named.
ENGINE_LAYOUT = "model across processes"
ENGINE = dict(max_num_seqs=4, page_size=8, num_pages=48, max_num_batched_tokens=16)
ENGINE_TOKENS = [12, 5, 9, 12, 7, 3, 10, 6]
LONG_PROMPT = "The old bridge over the river was closed for repairs in May, " * 2
ENGINE_PROMPTS = ([*PROMPTS, LONG_PROMPT] * 2)[: len(ENGINE_TOKENS)]


def _bill(plan) -> dict:
    return {
        "weights": plan.weights_bytes,
        "scratch": plan.scratch_bytes,
        "total": plan.total_bytes,
        "executables": {
            name: [e.argument, e.output, e.alias, e.temp, e.peak]
            for name, e in plan.executables.items()
        },
    }


def _layout(path: str, shape: tuple[int, int]) -> tuple[dict, object, object, object]:
    mesh = jax.make_mesh(shape, ("data", "model"))
    model, tokenizer = jaxlm.load(path, mesh=mesh, progress=False)
    # The plan compiles the steps that `generate` and `stream` run for prompts of up to
    # `PREFILL_CHUNK` tokens, so that both run its executables.
    plan = jaxlm.plan(
        model,
        max_batch=len(PROMPTS),
        max_seq_len=MAX_SEQ_LEN,
        prefill_chunk=PREFILL_CHUNK,
        steps=("generate", "start", "decode"),
    )
    kw = dict(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[], plan=plan)
    out = jaxlm.generate(model, tokenizer, PROMPTS, **kw)
    pieces = list(jaxlm.stream(model, tokenizer, PROMPTS, chunk_tokens=STREAM_CHUNK, **kw))
    # A budget of exactly the decode step's bill at `MAX_SEQ_LEN`: the largest that fits.
    budget = plan.executables["decode"].peak
    fitted = jaxlm.plan(
        model, max_batch=len(PROMPTS), budget=budget, prefill_chunk=PREFILL_CHUNK, steps=("decode",)
    )
    result = {
        "processes": [[d.process_index for d in row] for row in mesh.devices],
        "token_ids": [o.token_ids for o in out],
        "texts": [o.text for o in out],
        "stream": ["".join(d.text for d in row) for row in zip(*pieces, strict=True)],
        "bill": _bill(plan),
        "budget": budget,
        "budget_max_seq_len": fitted.max_seq_len,
    }
    return result, model, tokenizer, plan


def _engine(model, tokenizer) -> dict:
    """The engine's requests on this process: process 0 submits them (and cancels one more at
    once), the others follow; the token ids in submission order, or, where this process
    follows, in the order its requests finished."""
    with jaxlm.LLMEngine(model, tokenizer, **ENGINE) as engine:
        running = [engine.is_running]
        if jax.process_index() == 0:
            handles = [
                engine.submit(p, max_new_tokens=n, stop_token_ids=[])
                for p, n in zip(ENGINE_PROMPTS, ENGINE_TOKENS, strict=True)
            ]
            engine.submit(LONG_PROMPT, max_new_tokens=8, stop_token_ids=[]).cancel()
            outputs = [h.result() for h in handles]
            cancelled, refused = [], None
        else:
            try:
                engine.submit(LONG_PROMPT, max_new_tokens=8)
            except RuntimeError as error:
                refused = str(error)
            followed = list(engine.follow())
            outputs = [o for o in followed if o.finish_reason != "cancelled"]
            cancelled = [o for o in followed if o.finish_reason == "cancelled"]
        stats = engine.stats()
    running.append(engine.is_running)
    return {
        "token_ids": [o.token_ids for o in outputs],
        "texts": [o.text for o in outputs],
        "cancelled": len(cancelled),
        "refused": refused,
        "pages_in_use": stats.pages_in_use,
        "finished": stats.finished,
        "running": running,
    }


def main(path: str, out_file: str, processes: int, process_id: int, port: int) -> None:
    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # Short timeouts, so that a peer that never comes or dies fails this process soon.
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=processes,
            process_id=process_id,
            initialization_timeout=120,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT,
            shutdown_timeout_seconds=5,
        )
    results = {}
    for name, shape in LAYOUTS.items():
        results[name], model, tokenizer, plan = _layout(path, shape)
        results[name]["engine"] = _engine(model, tokenizer)
    if processes == 1:
        model, tokenizer = jaxlm.load(path, progress=False)
        out = jaxlm.generate(
            model, tokenizer, PROMPTS, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[]
        )
        results["one device"] = {
            "token_ids": [o.token_ids for o in out],
            "texts": [o.text for o in out],
            "engine": _engine(model, tokenizer),
        }
    partial = Path(f"{out_file}.partial")
    partial.write_text(json.dumps(results))
    os.replace(partial, out_file)
    if processes > 1:
        # On the last layout, whose steps exchange data between the processes.
        while True:
            jaxlm.generate(
                model,
                tokenizer,
                PROMPTS,
                max_new_tokens=MAX_NEW_TOKENS,
                stop_token_ids=[],
                plan=plan,
            )


if __name__ == "__main__":
    model_dir, out_file, processes, process_id, port = sys.argv[1:]
    main(model_dir, out_file, int(processes), int(process_id), int(port))
