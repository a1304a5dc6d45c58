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
from jaxlm.decoding import STEP_FUNCTIONS, DecodeState, decode_step, prefill_step
from jaxlm.memory import (
    Layout,
    declarations,
    set_path,
)
from jaxlm.sharding import Partitioner, mesh_of, shard_bytes

DEFAULT_PREFILL_CHUNK = 512
STOP_IDS_BUCKET = 8
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


class Generator:
    """Jitted steps of one model; shared by every plan of that model."""

    def __init__(self, model: nnx.Module):
        self.graphdef, self.params = nnx.split(model)
        self.config = model.config
        self.dtype = model.dtype
        self.decode_state = DecodeState()
        mesh = mesh_of(self.params)
        # Each row owns its pages, so the pages split over `data` with the rows.
        self.partitioner = (
            Partitioner(mesh, self.config, pages="data") if mesh is not None else None
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
        self.prefill_step = jit(prefill_step)
        self.decode_step = jit(decode_step)
        self.start = self.jitted("start")
        self.decode_loop = self.jitted("decode")
        self.generate = self.jitted("generate")
        self.generate_ngram = self.jitted("generate_ngram")
        self.decode_ngram = self.jitted("decode_ngram")
        # Plans made by `generate` for requests without one, by bucketed shape.
        self.plans: dict = {}
        # The bill of every plan built, by its sizes: a budget's search starts from them.
        self.bills: dict = {}

    def jitted(self, step: str):
        """A new jitted function of `step` (one of the names `jaxlm.plan`'s `steps` takes).

        Its traces are cached on it, so a plan that compiles through its own function and
        keeps only the executables lets the traces go (see `docs/performance.md`, "Host memory").
        """
        fn, static = STEP_FUNCTIONS[step]
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


def generator_of(model: nnx.Module) -> Generator:
    """The generator of `model`, made once per model object, also when threads ask at once."""
    with _GENERATORS_LOCK:
        generator = _GENERATORS.get(model)
        if generator is None:
            generator = _GENERATORS[model] = Generator(model)
    return generator


def forget(model: nnx.Module) -> None:
    """Drop the generator of `model`, with its plans and their scratch: for a model whose structure
    changed in place (`jaxlm.quantize`), whose steps no longer fit it. New weights in the same
    variables (`nnx.update`) need nothing: the generator's parameters are the model's variables."""
    with _GENERATORS_LOCK:
        _GENERATORS.pop(model, None)


def weights_bytes(model: nnx.Module) -> int:
    """Bytes of parameters each device holds (all of them on a single device)."""
    return sum(shard_bytes(x) for x in jax.tree.leaves(nnx.state(model)))


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
        arguments[f"{name}_ngram"] = (args, {**kwargs, "drafts": drafts})
    for name in ("start", "decode"):
        args, kwargs = arguments[name]
        arguments[f"{name}_masked"] = (args, {**kwargs, "mask": x["mask"]})
    unknown = set(steps) - set(arguments)
    if unknown or not steps:
        raise ValueError(f"`steps` must name some of {sorted(arguments)}, got {list(steps)}")
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
