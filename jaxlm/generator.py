"""The jitted steps over donated scratch, shared by every plan of a model (see `jaxlm.planner`).

Every step is `step(params, scratch, inputs) -> scratch (, outputs)` with `scratch` donated: XLA
writes the KV pages and the decode state in place and returns the same buffers. The model runs
its one cached forward, `forward_paged`, as the serving engine does; each row owns its pages.
The functions close over the model's graph definition and merge it with the parameters inside
the trace, far cheaper per call than `nnx.jit` in graph mode, which also copies every variable
(see `docs/performance.md`, "Tracing and dispatch").
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import stops
from jaxlm.batching.sampled import MAX_LOGIT_BIAS
from jaxlm.decoding import (
    DRAFT_STEP_FUNCTIONS,
    STEP_FUNCTIONS,
    DecodeState,
    decode_step,
    prefill_step,
)
from jaxlm.memory import (
    Layout,
    declarations,
    set_path,
)
from jaxlm.sharding import Partitioner, mesh_of

DEFAULT_PREFILL_CHUNK = 512
STOP_IDS_BUCKET = 8
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


class Generator:
    """Jitted steps of one model, or of a model and the draft model that drafts for it (`draft`);
    shared by every plan of that model (or pair)."""

    def __init__(self, model: nnx.Module, draft: nnx.Module | None = None):
        self.drafting = draft is not None
        self.table = DRAFT_STEP_FUNCTIONS if self.drafting else STEP_FUNCTIONS
        self.graphdef, self.params = nnx.split((model, draft) if self.drafting else model)
        self.config = model.config
        self.dtype = model.dtype
        self.decode_state = DecodeState()
        mesh = mesh_of(self.params)
        # Each row owns its pages, so the pages split over `data` with the rows.
        self.partitioner = (
            Partitioner(
                mesh, self.config, pages="data", draft=None if draft is None else draft.config
            )
            if mesh is not None
            else None
        )
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
        # A plan's raw steps (`Plan.prefill`, `Plan.decode`) run a model without a draft.
        self.prefill_step = None if self.drafting else jit(prefill_step)
        self.decode_step = None if self.drafting else jit(decode_step)
        # Each step of the table, jitted once: steps compiled on first use keep their traces.
        self.steps = {name: self.jitted(name) for name in self.table}
        # The generators of this model with each draft model (`generator_of`).
        self.drafted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Plans made by `generate` for requests without one, by bucketed shape.
        self.plans: dict = {}
        # The bill of every plan built, by its sizes: a budget's search starts from them.
        self.bills: dict = {}

    def jitted(self, step: str):
        """A new jitted function of `step` (one of the names `jaxlm.plan`'s `steps` takes).

        Its traces are cached on it, so a plan that compiles through its own function and
        keeps only the executables lets the traces go (see `docs/performance.md`, "Host memory").
        """
        fn, static = self.table[step]
        return self._jit(fn, static_argnames=static)

    def static_args(self, step: str) -> tuple[str, ...]:
        """The static arguments of `step` (`"chunk"`, `"drafts"`)."""
        return self.table[step][1]

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

    def declarations(self, models=None):
        """The scratch the steps run over: the model's pages, the draft model's (under
        `"draft"`), and the loop's state; `models` is the model, or `(model, draft)`."""
        models = nnx.merge(self.graphdef, self.params) if models is None else models
        model, draft = models if self.drafting else (models, None)
        drafted = [] if draft is None else declarations(draft, prefix=("draft",))
        state = declarations(self.decode_state, prefix=("decode",))
        return [*declarations(model), *drafted, *state]

    def abstract_inputs(self, batch: int, prompt_len: int):
        i32, f32 = jnp.int32, jnp.float32
        sds = jax.ShapeDtypeStruct
        bias = (batch, MAX_LOGIT_BIAS)
        params = {
            "params": {n: sds((batch,), i32 if n == "top_k" else f32) for n in SAMPLING_FIELDS},
            "penalties": {n: sds((batch,), f32) for n in ("presence", "frequency")},
            "bias_ids": sds(bias, i32),
            "bias": sds(bias, f32),
        }
        return {
            "prompt": sds((batch, prompt_len), i32),
            "lengths": sds((batch,), i32),
            "rng": sds((batch, 2), jnp.uint32),
            "params": params,
            "stops": {
                "ids": sds((STOP_IDS_BUCKET,), i32),
                "strings": sds((stops.MAX_STOPS, stops.STOP_BYTES), i32),
                "table": sds((self.config.vocab_size, stops.TOKEN_BYTES), jnp.uint8),
                "lengths": sds((self.config.vocab_size,), i32),
            },
            "limit": sds((), i32),
            "mask": sds((batch, -(-self.config.vocab_size // 32)), i32),
        }


_GENERATORS_LOCK = threading.Lock()
_GENERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generator_of(model: nnx.Module, draft: nnx.Module | None = None) -> Generator:
    """The generator of `model` (with `draft`, of the pair), made once per model object, also
    when threads ask at once."""
    with _GENERATORS_LOCK:
        generator = _GENERATORS.get(model)
        if generator is None:
            generator = _GENERATORS[model] = Generator(model)
        if draft is None:
            return generator
        drafted = generator.drafted.get(draft)
        if drafted is None:
            drafted = generator.drafted[draft] = Generator(model, draft)
        return drafted


def forget(model: nnx.Module) -> None:
    """Drop the generator of `model`, with its plans and their scratch: for a model whose structure
    changed in place (`jaxlm.quantize`), whose steps no longer fit it. New weights in the same
    variables (`nnx.update`) need nothing: the generator's parameters are the model's variables."""
    with _GENERATORS_LOCK:
        _GENERATORS.pop(model, None)
        for generator in _GENERATORS.values():
            generator.drafted.pop(model, None)


def compile_steps(
    generator: Generator, layout: Layout, chunk: int, steps: tuple[str, ...], drafts: int
) -> dict:
    """Compile `steps` for a plan's shapes, those with drafts for `drafts` tokens a step,
    without allocating anything."""
    sharded = generator.partitioner is not None
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if sharded else None),
        generator.params,
    )
    scratch = layout.abstract()
    batch = layout.dims["batch"]
    x = generator.abstract_inputs(batch, chunk)
    # The prompt's arguments, as `generate` and `start` both take them.
    prompt = (x["prompt"], x["lengths"], x["rng"], x["params"], x["stops"])
    arguments = {
        "generate": ((params, scratch, *prompt, x["limit"]), {"chunk": chunk}),
        "start": ((params, scratch, *prompt), {"chunk": chunk}),
        "decode": ((params, scratch, x["params"], x["stops"], x["limit"]), {}),
    }
    for name in ("generate", "decode"):
        args, kwargs = arguments[name]
        for drafted in (f"{name}_ngram", f"{name}_draft"):
            arguments[drafted] = (args, {**kwargs, "drafts": drafts})
    arguments["start_draft"] = arguments["start"]
    for name in ("start", "decode"):
        args, kwargs = arguments[name]
        arguments[f"{name}_masked"] = (args, {**kwargs, "mask": x["mask"]})
    if set(steps) - set(generator.table) or not steps:
        raise ValueError(f"`steps` must name some of {sorted(generator.table)}, got {list(steps)}")
    lowered = {}
    for name in steps:
        args, kwargs = arguments[name]
        lowered[name] = generator.jitted(name).lower(*args, **kwargs)
    return compile_side_by_side(lowered)


def compile_side_by_side(lowered: dict) -> dict:
    """Each of the `lowered` steps, compiled: XLA compiles, or loads from the persistent cache,
    without holding the GIL, so the steps compile side by side, one a core (see
    `docs/performance.md`, "Tracing and dispatch")."""
    workers = max(1, min(len(lowered), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {key: pool.submit(step.compile) for key, step in lowered.items()}
    return {key: future.result() for key, future in futures.items()}
