"""The jitted steps over donated scratch, and `plan`, which accounts for them before allocating.

Every step is `step(params, scratch, inputs) -> scratch (, outputs)` with `scratch` donated: XLA
writes the caches and the decode state in place and returns the same buffers. The functions
close over the model's graph definition and merge it with the parameters inside the trace,
which costs about 16 us per call (`nnx.jit` in graph mode costs about 300 us and copies every
variable; research Q4c).

The generation loop keeps its state in the `"decode"` part of the scratch:
- `tokens[b, s]` is the token at cache slot `s` of row `b`. Prompts are left-padded to a shared
  length `P`, so every row writes the same slot each step and the cache update is a single
  `dynamic_update_slice`. Generated tokens go to slots `P, P + 1, ...`.
- The token at slot `cache_index` has been sampled but not yet fed to the model.
- `num_generated[b]` counts the tokens of row `b` before its first stop token; `done[b]` is set
  once a stop token is sampled.
- `rng[b]` is row `b`'s key; the key of its `n`-th token is `fold_in(rng[b], n)`, so a row's
  samples depend neither on the other rows nor on how a stream is cut into chunks.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import sampling
from jaxlm.errors import PlanError
from jaxlm.memory import (
    Layout,
    ScratchSpec,
    declarations,
    parse_bytes,
    platform,
    set_path,
    write_cache,
)
from jaxlm.sharding import Partitioner, mesh_of, shard_bytes

PAGE = 256
DEFAULT_PREFILL_CHUNK = 512
STOP_IDS_BUCKET = 8
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


class DecodeState(nnx.Module):
    """The generation loop's own scratch, declared like the model's caches."""

    def __init__(self):
        self.tokens = ScratchSpec(
            ("batch", "seq"), jnp.int32, axes=("batch", None), doc="token at each cache slot"
        )
        self.rng = ScratchSpec(("batch", 2), jnp.uint32, axes=("batch", None), doc="PRNG key")
        self.done = ScratchSpec(("batch",), jnp.bool_, axes=("batch",), doc="stop token seen")
        self.num_generated = ScratchSpec(
            ("batch",), jnp.int32, axes=("batch",), doc="tokens before the stop"
        )
        self.prompt_end = ScratchSpec((), jnp.int32, doc="slot of the first generated token")


def _reset_and_prefill(model, scratch, prompt, lengths, chunk):
    """Reset the cache to the left-padded `prompt` [B, P] and run it in chunks of `chunk`."""
    b, p = prompt.shape
    m = scratch["model"]
    m = {**m, "cache_index": jnp.int32(0), "cache_start": (p - lengths).astype(jnp.int32)}
    state = {**scratch, "model": m}
    n_chunks = p // chunk

    def run(i, carry):
        state, _ = carry
        ids = jax.lax.dynamic_slice(prompt, (0, i * chunk), (b, chunk))
        logits, state = model.forward_cached(ids, state, last_only=True)
        return state, logits

    logits0 = jnp.zeros((b, model.config.vocab_size), jnp.float32)
    if n_chunks == 1:
        return run(0, (state, logits0))
    return jax.lax.fori_loop(0, n_chunks, run, (state, logits0))


def _sample_next(scratch, logits, params, stop_ids):
    """Sample the token after the cache's last slot and record it in the decode state."""
    d = scratch["decode"]
    m = scratch["model"]
    index = m["cache_index"]
    slots = jnp.arange(d["tokens"].shape[1])
    seen = (slots[None, :] >= m["cache_start"][:, None]) & (slots[None, :] < index)
    penalty = params["repetition_penalty"]
    # The penalty scatters over the whole vocabulary; most requests do not use it.
    logits = jax.lax.cond(
        jnp.any(penalty != 1.0),
        lambda x: sampling.apply_repetition_penalty(x, d["tokens"], seen, penalty),
        lambda x: x,
        logits,
    )
    step = index - d["prompt_end"]
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(d["rng"], step)
    token = sampling.sample(
        logits, keys, params["temperature"], params["top_k"], params["top_p"], params["min_p"]
    )
    is_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=1)
    done = d["done"]
    decode = {
        **d,
        "tokens": write_cache(d["tokens"], token[:, None], index, axis=1),
        "num_generated": d["num_generated"] + (~done & ~is_stop),
        "done": done | is_stop,
    }
    return {**scratch, "decode": decode}


def start(model, scratch, prompt, lengths, rng, params, stop_ids, chunk):
    """Prefill the prompts and sample each row's first token."""
    scratch, logits = _reset_and_prefill(model, scratch, prompt, lengths, chunk)
    b, p = prompt.shape
    d = scratch["decode"]
    tokens = jax.lax.dynamic_update_slice(d["tokens"], prompt, (0, 0))
    d = {
        **d,
        "tokens": tokens,
        "rng": rng,
        "done": jnp.zeros((b,), bool),
        "num_generated": jnp.zeros((b,), jnp.int32),
        "prompt_end": jnp.int32(p),
    }
    return _sample_next({**scratch, "decode": d}, logits, params, stop_ids)


def decode_loop(model, scratch, params, stop_ids, limit):
    """Decode until every row is done or `limit` tokens have been sampled in all."""

    def generated(s):
        return s["model"]["cache_index"] - s["decode"]["prompt_end"] + 1

    def cond(s):
        return (generated(s) < limit) & ~jnp.all(s["decode"]["done"])

    def body(s):
        index = s["model"]["cache_index"]
        token = jax.lax.dynamic_slice_in_dim(s["decode"]["tokens"], index, 1, axis=1)
        logits, s = model.forward_cached(token, s, last_only=True)
        return _sample_next(s, logits, params, stop_ids)

    return jax.lax.while_loop(cond, body, scratch)


class Engine:
    """Jitted steps of one model; shared by every plan of that model."""

    def __init__(self, model: nnx.Module):
        self.graphdef, self.params = nnx.split(model)
        self.config = model.config
        self.dtype = model.dtype
        self.decode_state = DecodeState()
        mesh = mesh_of(self.params)
        self.partitioner = Partitioner(mesh, self.config) if mesh is not None else None
        graphdef = self.graphdef
        pin = self._pin_scratch()

        def merged(fn):
            @functools.wraps(fn)
            def wrapper(params, scratch, *args, **kwargs):
                out = fn(nnx.merge(graphdef, params), scratch, *args, **kwargs)
                return (pin(out[0]), *out[1:]) if isinstance(out, tuple) else pin(out)

            return wrapper

        def jit(fn, **kwargs):
            # `keep_unused` keeps donated slots that a step overwrites without reading them
            # aliased to their outputs; otherwise JAX drops them and XLA allocates new buffers.
            return jax.jit(merged(fn), donate_argnums=1, keep_unused=True, **kwargs)

        self._jit = jit
        self.prefill_step = jit(_prefill_step)
        self.decode_step = jit(_decode_step)
        self.start = self.jitted("start")
        self.decode_loop = self.jitted("decode")
        self.generate = self.jitted("generate")
        # Plans made by `generate` for requests without one, by bucketed shape.
        self.plans: dict = {}

    def jitted(self, step: str):
        """A new jitted function of `step` (`"generate"`, `"start"` or `"decode"`).

        Its traces are cached on it, so a plan that compiles through its own function and
        keeps only the executables lets the traces go (about 35 MiB for SmolLM2's `generate`).
        """
        fn, static = _STEP_FUNCTIONS[step]
        return self._jit(fn, static_argnames=static)

    def _pin_scratch(self):
        """A function that keeps a step's returned scratch on the shardings it came in with.

        XLA aliases a donated buffer to an output only if both are split alike, and the plan
        promises every slot its sharding; on a single device there is nothing to pin.
        """
        if self.partitioner is None:
            return lambda scratch: scratch
        shardings: dict = {}
        for path, spec in self.declarations():
            set_path(shardings, path, self.partitioner.sharding(spec.axes))
        return lambda scratch: jax.lax.with_sharding_constraint(scratch, shardings)

    def declarations(self, model_module=None):
        model = nnx.merge(self.graphdef, self.params) if model_module is None else model_module
        return [*declarations(model), *declarations(self.decode_state, prefix=("decode",))]

    def abstract_inputs(self, batch: int, prompt_len: int):
        i32, f32 = jnp.int32, jnp.float32
        sds = jax.ShapeDtypeStruct
        params = {name: sds((batch,), i32 if name == "top_k" else f32) for name in SAMPLING_FIELDS}
        return {
            "prompt": sds((batch, prompt_len), i32),
            "lengths": sds((batch,), i32),
            "rng": sds((batch, 2), jnp.uint32),
            "params": params,
            "stop_ids": sds((STOP_IDS_BUCKET,), i32),
            "limit": sds((), i32),
        }


def _prefill_step(model, scratch, prompt, lengths):
    scratch, logits = _reset_and_prefill(model, scratch, prompt, lengths, prompt.shape[1])
    return scratch, logits


def _decode_step(model, scratch, tokens):
    logits, scratch = model.forward_cached(tokens[:, None], scratch, last_only=True)
    return scratch, logits


def _generate(model, scratch, prompt, lengths, rng, params, stop_ids, limit, chunk):
    scratch = start(model, scratch, prompt, lengths, rng, params, stop_ids, chunk)
    return decode_loop(model, scratch, params, stop_ids, limit)


# Each step run by a plan, and its static arguments.
_STEP_FUNCTIONS = {
    "generate": (_generate, ("chunk",)),
    "start": (start, ("chunk",)),
    "decode": (decode_loop, ()),
}

_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def engine_of(model: nnx.Module) -> Engine:
    """The engine of `model`, made once per model object, also when threads ask at once."""
    with _ENGINES_LOCK:
        engine = _ENGINES.get(model)
        if engine is None:
            engine = _ENGINES[model] = Engine(model)
    return engine


def weights_bytes(model: nnx.Module) -> int:
    """Bytes of parameters each device holds (all of them on a single device)."""
    return sum(shard_bytes(x) for x in jax.tree.leaves(nnx.state(model)))


def plan(
    model: nnx.Module,
    *,
    max_batch: int = 1,
    max_seq_len: int | None = None,
    budget: int | str | None = None,
    prefill_chunk: int | None = None,
    steps: tuple[str, ...] = ("generate", "decode"),
):
    """Plan the scratch of `model` for `max_batch` rows of `max_seq_len` tokens, allocating nothing.

    The plan compiles the generation steps for these shapes and reads XLA's memory analysis, so
    `plan.total_bytes` is the whole bill: weights + scratch + XLA's temporaries. With `budget`
    (bytes or a string like `"1.5GiB"`) and no `max_seq_len`, it picks the largest multiple of
    256 tokens whose bill fits; with both, it raises `PlanError` if the bill exceeds the budget.
    `steps` names the executables to compile and account for: `"generate"` (prefill of a
    `prefill_chunk`-token prompt and the decode loop, in one call, as `generate` runs it),
    `"start"` (the prefill and first token alone, as `stream` begins) and `"decode"` (the decode
    loop alone, as `stream` runs it between chunks). Prompts shorter than `prefill_chunk` run
    executables of their own bucket, compiled on first use; their temporaries are smaller.
    Works on abstract models (`nnx.eval_shape`) too.

    On a model sharded over a mesh (`jaxlm.load(..., mesh=...)` or `jaxlm.shard`), every slot
    is split as it declares (the KV cache by batch row on `data` and by KV head on `model`),
    the bill is per device (XLA's memory analysis of a partitioned step is per device), the
    budget is per device, and `max_batch` must be a multiple of the `data` axis.

    Example:
        >>> plan = jaxlm.plan(model, max_batch=4, max_seq_len=2048)
        >>> print(plan)                  # slots, bytes, XLA temporaries, the whole bill
        >>> scratch = plan.allocate()    # the one allocation of scratch
    """
    from jaxlm.planner import Plan

    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"`max_batch` must be a positive integer, got {max_batch!r}")
    limit = parse_bytes(budget) if budget is not None else None
    if max_seq_len is None and limit is None:
        raise ValueError("give `max_seq_len`, `budget`, or both")
    engine = engine_of(model)

    def make(seq: int) -> Plan:
        chunk = min(prefill_chunk or DEFAULT_PREFILL_CHUNK, seq)
        return Plan.build(engine, model, max_batch, seq, chunk, limit, steps)

    def floor(seq: int) -> int:
        # Weights and scratch, known without compiling: a lower bound of the bill.
        dims = {"batch": max_batch, "seq": seq}
        layout = Layout.build(decls, dims, platform(), engine.partitioner)
        return weights_bytes(model) + layout.device_nbytes

    decls = engine.declarations(model)
    if engine.partitioner is not None:
        engine.partitioner.check_batch(max_batch)
    if max_seq_len is not None:
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"`max_seq_len` must be an integer >= 2, got {max_seq_len!r}")
        p = make(max_seq_len)
        if limit is not None and p.total_bytes > limit:
            raise PlanError(p.over_budget_message(limit, _fit(make, floor, limit, engine.config)))
        return p
    best = _fit(make, floor, limit, engine.config)
    if best is None:
        raise PlanError(make(PAGE).over_budget_message(limit, None))
    return best


def _fit(make, floor, limit: int, config) -> object | None:
    """The plan with the most pages of 256 tokens whose bill fits `limit`, or None.

    Weights and scratch grow linearly with the pages and are known without compiling, so a
    cheap bisection bounds the answer; plans are compiled only from that bound down: the bound
    itself first (XLA's temporaries are usually small), then a bisection below it.
    """
    lo, hi = 1, max(1, -(-config.max_position_embeddings // PAGE))
    if floor(lo * PAGE) > limit:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if floor(mid * PAGE) <= limit else (lo, mid - 1)
    top = make(hi * PAGE)
    if top.total_bytes <= limit:
        return top
    lo, hi, best = 1, hi - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = make(mid * PAGE)
        if candidate.total_bytes <= limit:
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    return best


def compile_steps(engine: Engine, layout: Layout, chunk: int, steps: tuple[str, ...]) -> dict:
    """Compile `steps` for a plan's shapes, without allocating anything."""
    sharded = engine.partitioner is not None
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if sharded else None),
        engine.params,
    )
    scratch = layout.abstract()
    batch = layout.dims["batch"]
    x = engine.abstract_inputs(batch, chunk)
    # The prompt's arguments, as `generate` and `start` both take them.
    prompt = (x["prompt"], x["lengths"], x["rng"], x["params"], x["stop_ids"])
    arguments = {
        "generate": ((params, scratch, *prompt, x["limit"]), {"chunk": chunk}),
        "start": ((params, scratch, *prompt), {"chunk": chunk}),
        "decode": ((params, scratch, x["params"], x["stop_ids"], x["limit"]), {}),
    }
    unknown = set(steps) - set(arguments)
    if unknown or not steps:
        raise ValueError(f"`steps` must name some of {sorted(arguments)}, got {list(steps)}")
    lowered = {}
    for name in steps:
        args, kwargs = arguments[name]
        lowered[name] = engine.jitted(name).lower(*args, **kwargs)
    # XLA compiles, or loads from the persistent cache, without holding the GIL: loading
    # SmolLM2's `start` and `decode` side by side took 1.2 s instead of 1.6 s.
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        futures = {name: pool.submit(step.compile) for name, step in lowered.items()}
    return {name: future.result() for name, future in futures.items()}
