"""The `jaxlm` command line: `generate`, `chat`, `plan`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CACHE_DIR = Path(os.environ.get("JAXLM_CACHE_DIR", Path.home() / ".cache" / "jaxlm"))
# Seconds: `jaxlm serve`'s GIL switch interval, a tenth of Python's default.
SERVE_SWITCH_INTERVAL = 5e-4


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _dtype(name: str):
    import jax.numpy as jnp

    choices = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if name not in choices:
        raise argparse.ArgumentTypeError(f"invalid dtype {name!r}; choose from {sorted(choices)}")
    return choices[name]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _mesh(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not DATA,MODEL (e.g. 1,4)")
    return _positive_int(parts[0]), _positive_int(parts[1])


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face directory or .gguf file (default: SmolLM2-135M)")
    p.add_argument("--dtype", type=_dtype, default="float32", help="float32, bfloat16, float16")
    p.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        default=None,
        help="store the weights in int8 or int4 (`--dtype` is then the norms' and the KV cache's)",
    )
    p.add_argument(
        "--mesh",
        type=_mesh,
        default=None,
        metavar="DATA,MODEL",
        help="split the model over DATA x MODEL devices (e.g. 1,4: 4-way tensor parallel)",
    )


# `jaxlm.speculative.METHODS`, named here so that parsing the arguments imports no JAX.
SPECULATIVE = ("ngram",)


def _sampling_options(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=max_new)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        default=None,
        help="draft tokens from the prompt and check them in the same step (the same output)",
    )
    _drafts_option(p)


def _drafts_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft tokens with this smaller model of the same tokenizer instead (a .gguf file "
        "or Hugging Face directory; `same`: --model again), checked the same way",
    )
    p.add_argument(
        "--draft-quantize",
        choices=("int8", "int4"),
        default=None,
        help="store the draft model's weights in int8 or int4",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=_positive_int,
        default=None,
        help="tokens drafted a step with --speculative (default 3)",
    )


def _processes_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "several hosts",
        "run the same command on every host, each with its own --process-id, and a --mesh over "
        "all their devices: process 0 serves, the others run its steps",
    )
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
    g.add_argument("--num-processes", type=_positive_int, default=None, help="processes in all")
    g.add_argument("--process-id", type=int, default=None, help="this process, from 0")


def _processes(args) -> dict | None:
    """`jax.distributed.initialize`'s arguments from `--coordinator`, `--num-processes` and
    `--process-id` (None without them), checked before anything loads."""
    given = {
        "--coordinator": args.coordinator,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    if all(v is None for v in given.values()):
        return None
    missing = [name for name, v in given.items() if v is None]
    if missing:
        raise ValueError(f"several processes need {', '.join(f'`{m}`' for m in missing)} too")
    if args.mesh is None:
        raise ValueError("several processes need `--mesh` over the devices of all of them")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"`--coordinator` must be HOST:PORT, got {args.coordinator!r}")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(
            f"`--process-id` must be from 0 to {args.num_processes - 1} "
            f"(`--num-processes {args.num_processes}`), got {args.process_id}"
        )
    return dict(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )


def _join(processes: dict, mesh: tuple[int, int]) -> None:
    """Join the other processes (`jax.distributed`), before anything touches a device; the
    mesh must then hold every process's devices, so that each step is all of theirs."""
    import math

    import jax

    # JAX's CPU collectives between processes; other platforms have their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**processes)
    if math.prod(mesh) != jax.device_count():
        raise ValueError(
            f"`--mesh {mesh[0]},{mesh[1]}` holds {math.prod(mesh)} devices; across "
            f"{processes['num_processes']} processes it must hold all {jax.device_count()}"
        )


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# The steps `jaxlm.plan` compiles, by name.
PLAN_STEPS = ("generate", "start", "decode")


def _params(args):
    """The sampling parameters of `generate` and `chat`, checked: a bad one is refused before
    the model loads."""
    from jaxlm.requests import SamplingParams

    fields = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
    return SamplingParams(args.max_new_tokens, seed=args.seed, stop=args.stop, **fields)


def _check_drafts(args) -> None:
    """Refuse a bad drafting option before the model loads."""
    from jaxlm.speculative import drafts_of

    draft = getattr(args, "draft_model", None)
    if draft is not None and args.speculative is not None:
        raise ValueError("give `--speculative` or `--draft-model`, not both")
    if getattr(args, "draft_quantize", None) is not None and draft is None:
        raise ValueError("`--draft-quantize` needs `--draft-model`")
    if draft not in (None, "same") and not Path(draft).exists():
        raise ValueError(f"`--draft-model` {draft}: no such file or directory")
    drafts_of("ngram" if draft is not None else args.speculative, args.num_speculative_tokens)


def _speculative(args) -> dict:
    """The drafting arguments of `generate` and `LLMEngine`: the method, or the draft model,
    loaded."""
    speculative = args.speculative
    if args.draft_model is not None:
        import jaxlm

        path = args.model if args.draft_model == "same" else args.draft_model
        speculative, _ = jaxlm.load(
            path, dtype=args.dtype, quantize=args.draft_quantize, mesh=args.mesh
        )
    return dict(speculative=speculative, num_speculative_tokens=args.num_speculative_tokens)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jaxlm", description="Run Llama-family language models with JAX.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    g.add_argument("prompt")
    _model_options(g)
    _sampling_options(g, max_new=64)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _model_options(c)
    c.add_argument("--system", default=None, help="a system message")
    _sampling_options(c, max_new=256)

    pl = sub.add_parser("plan", help="print the memory plan without allocating the scratch")
    _model_options(pl)
    pl.add_argument("--max-batch", type=_positive_int, default=1)
    pl.add_argument("--max-seq-len", type=_positive_int, default=None)
    pl.add_argument("--budget", default=None, help="bytes or a size such as 1.5GiB")
    pl.add_argument("--prefill-chunk", type=_positive_int, default=None)
    pl.add_argument(
        "--steps",
        nargs="+",
        choices=PLAN_STEPS,
        default=None,
        help="the steps to compile and bill: generate (prompt and decode loop in one call), "
        "start and decode (as streaming runs them); default: generate decode",
    )

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs `jaxlm[serve]`)")
    _model_options(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the `model` clients name")
    s.add_argument("--max-num-seqs", type=_positive_int, default=8, help="sequences at once")
    s.add_argument("--max-seq-len", type=_positive_int, default=None, help="tokens a sequence")
    s.add_argument("--page-size", type=_positive_int, default=16, help="tokens a KV page")
    s.add_argument(
        "--budget", default=None, help="memory for the engine (e.g. 4GiB): it picks the pages"
    )
    s.add_argument("--num-pages", type=_positive_int, default=None, help="KV pages, instead")
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=256)
    s.add_argument(
        "--decode-steps", type=_positive_int, default=4, help="decode steps per XLA call"
    )
    s.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    s.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        default=None,
        help="requests draft tokens from their own text, checked in the same step",
    )
    _drafts_option(s)
    s.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral", "json"),
        default=None,
        help="how tool calls are read from the output (default: from the chat template)",
    )
    _processes_options(s)
    s.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds requests may run on after SIGINT or SIGTERM before they are cut",
    )

    b = sub.add_parser("bench", help="benchmark prefill and decode (see benchmarks/bench.py)")
    _model_options(b)
    from jaxlm.bench import add_arguments

    add_arguments(b)
    return p


def enable_compilation_cache() -> None:
    """Keep compiled executables on disk, so a second start skips XLA compilation: in JAX's
    own `JAX_COMPILATION_CACHE_DIR` where that is set, else under `JAXLM_CACHE_DIR`."""
    import jax

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(CACHE_DIR / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _generate(args) -> None:
    import jaxlm

    model, tokenizer = jaxlm.load(
        args.model, dtype=args.dtype, mesh=args.mesh, quantize=args.quantize
    )
    wrote = False
    params, drafting = _params(args), _speculative(args)
    for delta in jaxlm.stream(model, tokenizer, args.prompt, params, **drafting):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        wrote = wrote or bool(delta.text)
    sys.stdout.write("\n")
    if not wrote:
        print(
            "jaxlm: the model stopped before writing any text (a stop token or `--stop` string "
            "came first); an instruct model may answer in `jaxlm chat`",
            file=sys.stderr,
        )


def _chat(args) -> None:
    import jaxlm

    model, tokenizer = jaxlm.load(
        args.model, dtype=args.dtype, mesh=args.mesh, quantize=args.quantize
    )
    drafting = _speculative(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chat with the model; /reset starts over, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        text = line.strip()
        if text == "/exit":
            return
        if text == "/reset":
            messages = list(system)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        pieces = jaxlm.chat(model, tokenizer, messages, _params(args), stream=True, **drafting)
        for piece in pieces:
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def _plan(args) -> None:
    import jaxlm
    from jaxlm.loading import default_model_path, open_checkpoint
    from jaxlm.models import model_class
    from jaxlm.quantization import check_quantize

    path = Path(args.model) if args.model else default_model_path()
    config = jaxlm.ModelConfig.from_hf_config(open_checkpoint(path).config)
    # The plan needs shapes only: an abstract model holds no weights.
    check_quantize(args.quantize, args.dtype)
    model = model_class(config).abstract(config, dtype=args.dtype, quantize=args.quantize)
    if args.mesh is not None:
        model = jaxlm.shard(model, args.mesh)
    plan = jaxlm.plan(
        model,
        max_batch=args.max_batch,
        max_seq_len=args.max_seq_len,
        budget=args.budget,
        prefill_chunk=args.prefill_chunk,
        steps=tuple(dict.fromkeys(args.steps)) if args.steps else None,
    )
    print(plan)


def _serve(args) -> None:
    import jaxlm
    from jaxlm.loading import default_model_path

    try:
        from jaxlm import serve
    except ImportError as e:
        raise ValueError(
            f"`jaxlm serve` needs the serve extra: pip install 'jaxlm[serve]' ({e})"
        ) from None
    processes = _processes(args)
    if processes is not None:
        _join(processes, args.mesh)
    model, tokenizer = jaxlm.load(
        args.model, dtype=args.dtype, mesh=args.mesh, quantize=args.quantize
    )
    # Without `--num-pages` or `--budget`, the plan gives every sequence room at its longest.
    max_seq_len = args.max_seq_len or min(model.config.max_position_embeddings, 4096)
    name = args.served_model_name or Path(args.model or default_model_path()).stem
    # The event loop's thread holds the GIL between requests' events; the engine's thread,
    # back from XLA, waits up to the switch interval for it (`docs/performance.md`, "The
    # engine's thread and the GIL").
    sys.setswitchinterval(SERVE_SWITCH_INTERVAL)
    print(f"jaxlm serve: compiling the steps of `{name}`...", file=sys.stderr)
    engine = jaxlm.LLMEngine(
        model,
        tokenizer,
        max_num_seqs=args.max_num_seqs,
        max_seq_len=max_seq_len,
        page_size=args.page_size,
        num_pages=args.num_pages,
        budget=args.budget,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache=not args.no_prefix_cache,
        decode_steps=args.decode_steps,
        **_speculative(args),
    )
    if processes is not None and processes["process_id"] != 0:
        print(f"{engine.plan}\nrunning the steps of process 0", file=sys.stderr)
        # Until process 0 closes the engine, when its server stops.
        for _ in engine.follow():
            pass
        return
    print(f"{engine.plan}\nserving at http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve.run(
        engine,
        name,
        host=args.host,
        port=args.port,
        grace=args.shutdown_grace,
        tool_call_parser=args.tool_call_parser,
    )


def _without_ynnpack(dtype, quantize) -> None:
    """Turn off XLA:CPU's YNNPACK fusions for a float32 model, unless `XLA_FLAGS` says otherwise.

    They build their runtime on each executable's first run, paid once per command, while
    float32 batch-1 decode runs as fast without them; bfloat16 matmuls need them (see
    `docs/performance.md`, "YNNPACK fusions in the command line"). `jaxlm bench` keeps them,
    as the library does, and so does an int8 model, whose integer products need them. Takes
    effect only before JAX starts its CPU backend.
    """
    import numpy as np

    flags = os.environ.get("XLA_FLAGS", "")
    if quantize is not None or np.dtype(dtype) != np.float32:
        return
    if "--xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_experimental_ynn_fusion_type=".strip()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in ("generate", "chat", "serve"):
        _without_ynnpack(args.dtype, args.quantize)
    enable_compilation_cache()
    commands = {"generate": _generate, "chat": _chat, "plan": _plan, "serve": _serve}
    try:
        # Refuse a bad value before the model loads, not after.
        if args.command in ("generate", "chat"):
            _params(args)
        if args.command == "serve":
            _processes(args)
        if args.command in ("generate", "chat", "serve"):
            _check_drafts(args)
        if args.command == "bench":
            from jaxlm.bench import run

            run(args)
        else:
            commands[args.command](args)
    except (ValueError, OSError) as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
