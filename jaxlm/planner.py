"""`plan` and `Plan`: a model's scratch laid out and its whole memory bill, before anything is
allocated."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.batching.plan import plan_engine
from jaxlm.bill import Bill
from jaxlm.budget import SEQ_STEP, fit
from jaxlm.decoding import page_count
from jaxlm.errors import PlanError
from jaxlm.generator import (
    DEFAULT_PREFILL_CHUNK,
    Generator,
    compile_steps,
    generator_of,
)
from jaxlm.memory import (
    ExecutableMemory,
    Layout,
    format_bytes,
    parse_bytes,
    release_host_memory,
    resident_bytes,
)
from jaxlm.ops import platform, storage_dtype
from jaxlm.sharding import weights_bytes
from jaxlm.speculative import check_draft, check_weights, drafts_of


class Plan(Bill):
    """The scratch of one model for `max_batch` rows of `max_seq_len` tokens, and its bill.

    Attributes: `max_batch`, `max_seq_len`, `prefill_chunk`, `num_speculative_tokens` (the
    tokens a step of the `_ngram` and `_draft` steps drafts), `layout` (the slots),
    `weights_bytes`, `scratch_bytes`, `compiled` (the compiled steps, by name), `executables`
    (XLA's memory analysis of each), `temp_bytes` (the largest XLA temporaries) and
    `total_bytes` (the whole bill: the peak of the most demanding step, weights and scratch
    included). On a mesh (`mesh` is not None), every byte count is per device.

    `executables_host_bytes` is the host memory the compiled steps hold: XLA reports no size
    for it on the CPU (`generated_code_size_in_bytes` is 0), yet a step holds its instructions,
    buffer assignments and kernels (see `docs/performance.md`, "Host memory"), so the plan
    measures it as
    the growth of the process's resident memory across compiling, which also counts the traces
    JAX keeps of the steps and, in a process's first plan, the compiler's one-time state (None
    outside Linux; other threads allocating meanwhile count too). On the CPU,
    `resident_bytes` adds it to the bill.
    """

    def __init__(
        self,
        generator: Generator,
        layout: Layout,
        prefill_chunk: int,
        weights: int,
        compiled: dict,
        budget: int | None,
        num_speculative_tokens: int,
        executables_host_bytes: int | None = None,
    ):
        self.generator = generator
        self.layout = layout
        self.max_batch = layout.dims["batch"]
        self.max_seq_len = layout.dims["seq"]
        self.prefill_chunk = prefill_chunk
        self.num_speculative_tokens = num_speculative_tokens
        self.weights_bytes = weights
        self.compiled = compiled
        self.executables = {name: ExecutableMemory.of(name, c) for name, c in compiled.items()}
        self.budget = budget
        self.executables_host_bytes = executables_host_bytes
        self.mesh = generator.partitioner.mesh if generator.partitioner else None
        self._pool: list[dict] = []
        self.pooling = True
        self._pool_lock = threading.Lock()
        self._ran = False

    @classmethod
    def build(cls, generator, model, max_batch, max_seq_len, chunk, budget, steps, drafts) -> Plan:
        layout = _layout(generator, generator.declarations(model), max_batch, max_seq_len)
        before = resident_bytes(settled=True)
        compiled = compile_steps(generator, layout, chunk, steps, drafts)
        plan = cls(generator, layout, chunk, weights_bytes(model), compiled, budget, drafts)
        # The steps were traced by jitted functions of their own, which die in reference
        # cycles; collecting them frees their traces. Reading XLA's memory analysis frees heap,
        # which the settling returns too.
        after = resident_bytes(settled=True)
        if before is not None and after is not None:
            plan.executables_host_bytes = max(0, after - before)
        return plan

    @property
    def resident_bytes(self) -> int | None:
        """On the CPU, the memory the plan keeps resident in this process while it runs: the
        whole bill and the compiled steps' host memory. None where that was not measured or
        the bill is of another device's memory.
        """
        if self.executables_host_bytes is None or self.mesh is not None or platform() != "cpu":
            return None
        return self.total_bytes + self.executables_host_bytes

    @property
    def kv_cache_bytes(self) -> int:
        names = ("k_pages", "v_pages")
        return sum(s.device_nbytes for s in self.layout.slots if s.name in names)

    def over_budget_message(self, budget: int, fitting: Plan | None) -> str:
        return (
            f"the plan for `max_batch={self.max_batch}`, `max_seq_len={self.max_seq_len}` needs "
            f"{format_bytes(self.total_bytes)} (weights {format_bytes(self.weights_bytes)}, "
            f"scratch {format_bytes(self.scratch_bytes)}, XLA temporaries "
            f"{format_bytes(self.temp_bytes)}), over the budget of {format_bytes(budget)}; "
            f"{_fitting(fitting, self.max_batch)}"
        )

    # Running.

    def allocate(self) -> dict:
        """Create the scratch: zero-filled arrays, exactly `scratch_bytes` in all."""
        return self.layout.allocate()

    def take(self) -> dict:
        """A scratch for one request: a free one from the plan's pool, else a new allocation.

        Each request in flight holds its own scratch, so concurrent requests never share
        donated buffers; the pool grows to the number of requests run at once.
        """
        with self._pool_lock:
            if self._pool:
                return self._pool.pop()
        return self.allocate()

    def keep(self, scratch: dict) -> None:
        """Return a scratch to the plan's pool once its request is done; a plan that does not
        pool (`generate` pools only in the plan it used last) drops it."""
        with self._pool_lock:
            if self.pooling:
                self._pool.append(scratch)

    def release(self) -> None:
        """Drop the idle scratch of the pool and stop pooling: the plan's scratch now lives only
        while a request runs it."""
        with self._pool_lock:
            self.pooling = False
            self._pool.clear()

    @property
    def pooled(self) -> bool:
        """Whether the plan holds idle scratch."""
        return bool(self._pool)

    def step(self, name: str, prompt_len: int | None = None, chunk: int | None = None):
        """The executable of step `name` (one of `jaxlm.plan`'s `steps`) for prompts of
        `prompt_len` tokens run in chunks of `chunk`: the plan's own if it compiled that step
        for those shapes, otherwise the generator's jitted step, compiled on first use.

        The plan's executable is the one its bill accounts for, and calling it skips the trace
        that a call through the jitted step would make again.
        """
        decode = name.startswith("decode")
        if name in self.compiled and (decode or prompt_len == chunk == self.prefill_chunk):
            return self.compiled[name]
        given = {"chunk": chunk, "drafts": self.num_speculative_tokens}
        static = {k: given[k] for k in self.generator.static_args(name)}
        return functools.partial(self.generator.steps[name], **static)

    def ran(self) -> None:
        """Note that a step of the plan has run; after the first, hand back the heap it freed.

        The first run of an XLA:CPU executable allocates and frees working memory beyond the
        temporaries of its memory analysis, which glibc keeps mapped; later runs need little
        of it (see `docs/performance.md`, "Host memory").
        """
        if not self._ran:
            self._ran = True
            release_host_memory()

    def _check_raw(self) -> None:
        if self.generator.drafting:
            raise PlanError(
                "`prefill` and `decode` run a plan without a draft model; this one drafts with "
                "one: run it through `generate` or `stream`"
            )

    def _check_batch(self, batch: int) -> None:
        if batch > self.max_batch:
            raise PlanError(
                f"batch of {batch} rows exceeds the plan's `max_batch={self.max_batch}`"
            )

    def _pad_rows(self, x: np.ndarray, fill) -> np.ndarray:
        pad = self.max_batch - x.shape[0]
        return np.concatenate([x, np.full((pad, *x.shape[1:]), fill, x.dtype)]) if pad else x

    def prefill(self, scratch: dict, prompt, lengths=None) -> tuple[dict, jax.Array]:
        """Reset the cache and run left-padded `prompt` `[batch, t]` (row `b`'s tokens are the last
        `lengths[b]`); returns the updated scratch and the logits `[batch, vocab]` of the last
        position. `scratch` is donated: use the returned one.
        """
        self._check_raw()
        prompt = np.asarray(prompt, np.int32)
        if prompt.ndim != 2:
            raise ValueError(f"`prompt` must be [batch, seq], got shape {prompt.shape}")
        b, t = prompt.shape
        self._check_batch(b)
        if t > self.max_seq_len:
            raise PlanError(
                f"prompt of {t} tokens exceeds the plan's `max_seq_len={self.max_seq_len}`"
            )
        lengths = np.full((b,), t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        if lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > t:
            raise ValueError(f"`lengths` must be {b} values in [1, {t}], got {lengths.tolist()}")
        self.layout.check(scratch)
        # The rows' positions start at their first slot, as the engine's do.
        rows = np.zeros_like(prompt)
        for i, n in enumerate(lengths):
            rows[i, :n] = prompt[i, t - n :]
        scratch, logits = self.generator.prefill_step(
            self.generator.params, scratch, self._pad_rows(rows, 0), self._pad_rows(lengths, 1)
        )
        return scratch, logits[:b]

    def decode(self, scratch: dict, tokens) -> tuple[dict, jax.Array]:
        """Feed one token per row (`tokens` `[batch]`) at the next cache slot; returns the
        updated scratch and the logits `[batch, vocab]`. `scratch` is donated.
        """
        self._check_raw()
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        self._check_batch(tokens.shape[0])
        self.layout.check(scratch)
        # One read of a replicated value: the rows' lengths may lie on other processes' devices.
        d = scratch["decode"]
        if int(jnp.max(d["prompt_len"]) + d["index"]) >= self.max_seq_len:
            raise PlanError(f"the cache is full: `max_seq_len={self.max_seq_len}` tokens")
        scratch, logits = self.generator.decode_step(
            self.generator.params, scratch, self._pad_rows(tokens, 0)
        )
        return scratch, logits[: tokens.shape[0]]

    # Reporting (`jaxlm.bill.Bill`).

    def _header(self) -> str:
        return (
            f"Plan: max_batch={self.max_batch}, max_seq_len={self.max_seq_len}, "
            f"prefill_chunk={self.prefill_chunk}, {self._where(self.generator.partitioner)}"
        )

    def _extra_totals(self) -> list[tuple[str, str]]:
        lines = []
        if self.executables_host_bytes is not None:
            lines.append(
                ("compiled steps (host memory)", format_bytes(self.executables_host_bytes))
            )
        if self.resident_bytes is not None:
            lines.append(("resident while running", format_bytes(self.resident_bytes)))
        return lines

    def __repr__(self) -> str:
        per_device = "" if self.mesh is None else f" per device on {self.mesh.size}"
        return (
            f"Plan(max_batch={self.max_batch}, max_seq_len={self.max_seq_len}, "
            f"total={format_bytes(self.total_bytes)}{per_device})"
        )


def plan(
    model: nnx.Module,
    *,
    max_batch: int | None = None,
    max_seq_len: int | None = None,
    budget: int | str | None = None,
    prefill_chunk: int | None = None,
    steps: tuple[str, ...] | None = None,
    max_num_seqs: int | None = None,
    num_pages: int | None = None,
    page_size: int | None = None,
    max_num_batched_tokens: int | None = None,
    decode_steps: int | None = None,
    speculative: str | nnx.Module | None = None,
    num_speculative_tokens: int | None = None,
):
    """Plan the scratch of `model` for `max_batch` rows of `max_seq_len` tokens, allocating nothing;
    with `max_num_seqs`, plan a serving engine's pages instead (below).

    The plan compiles the generation steps for these shapes and reads XLA's memory analysis, so
    `plan.total_bytes` is the whole bill: weights + scratch + XLA's temporaries. With `budget`
    (bytes or a string like `"1.5GiB"`) and no `max_seq_len`, it picks the largest multiple of
    256 tokens whose bill fits; with both, it raises `PlanError` if the bill exceeds the budget.
    `steps` names the executables to compile and account for: `"generate"` (prefill of a
    `prefill_chunk`-token prompt and the decode loop, in one call, as `generate` runs it),
    `"start"` (the prefill and first token alone, as `stream` begins) and `"decode"` (the decode
    loop alone, as `stream` runs it between chunks), and `"start_masked"` and `"decode_masked"`,
    the same with each row's token mask (`response_format`, a token a call), and
    `"generate_ngram"` and `"decode_ngram"`, the same with prompt-lookup drafts
    (`speculative="ngram"`), `num_speculative_tokens` (3) a step. With a draft model as
    `speculative` (a smaller model of the same vocabulary), the steps are `"generate_draft"`,
    `"start_draft"` and `"decode_draft"` (the first and last unless `steps` says otherwise), and
    the bill counts the draft model's weights and pages too. Prompts shorter
    than `prefill_chunk` run executables of their own bucket, compiled on first use; their
    temporaries are smaller.
    Works on abstract models (`nnx.eval_shape`) too.

    On a model sharded over a mesh (`jaxlm.load(..., mesh=...)` or `jaxlm.shard`), every slot
    is split as it declares (the KV cache by batch row on `data` and by KV head on `model`),
    the bill is per device (XLA's memory analysis of a partitioned step is per device), the
    budget is per device, and `max_batch` must be a multiple of the `data` axis.

    Example:
        >>> plan = jaxlm.plan(model, max_batch=4, max_seq_len=2048)
        >>> print(plan)                  # slots, bytes, XLA temporaries, the whole bill
        >>> scratch = plan.allocate()    # the one allocation of scratch

    With `max_num_seqs`, the plan is an `LLMEngine`'s (`jaxlm.batching.plan.EnginePlan`): the
    pages the attention layers declare, `num_pages` of `page_size` tokens (16), or as many as
    `budget` leaves, or without either, enough for every sequence at its longest; sequences of
    up to `max_seq_len` tokens (the model's context); and the
    engine's step compiled for each prompt chunk width up to `max_num_batched_tokens` (256),
    decoding `decode_steps` (4) tokens per call, and with `speculative="ngram"` the decode
    step that verifies `num_speculative_tokens` (3) drafted tokens at a time. Its bill is read
    from those executables too. On a mesh, each shard of `data` runs its own slots over its own
    pages: `max_num_seqs` and `num_pages` must be multiples of `data`.

        >>> plan = jaxlm.plan(model, max_num_seqs=8, budget="2GiB")
        >>> plan.num_pages, plan.total_bytes     # fitted before any allocation
        >>> engine = jaxlm.LLMEngine(model, tokenizer, plan)
    """
    if max_num_seqs is not None:
        static = dict(max_batch=max_batch, prefill_chunk=prefill_chunk, steps=steps)
        given = [f"`{k}`" for k, v in static.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} size `generate`'s plan, not an engine's")
        return plan_engine(
            model,
            max_num_seqs=max_num_seqs,
            max_seq_len=max_seq_len,
            page_size=page_size,
            num_pages=num_pages,
            budget=budget,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_steps=decode_steps,
            speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
        )
    draft = speculative if isinstance(speculative, nnx.Module) else None
    paged = dict(
        num_pages=num_pages,
        page_size=page_size,
        max_num_batched_tokens=max_num_batched_tokens,
        decode_steps=decode_steps,
        speculative=None if draft is not None else speculative,
    )
    given = [f"`{k}`" for k, v in paged.items() if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} size an engine's plan: give `max_num_seqs` too")
    max_batch = 1 if max_batch is None else max_batch
    if steps is None:
        steps = ("generate_draft", "decode_draft") if draft is not None else ("generate", "decode")
    drafting = any(str(name).endswith(("_ngram", "_draft")) for name in steps)
    if num_speculative_tokens is not None and not drafting:
        raise ValueError(
            "`num_speculative_tokens` sizes the steps with drafts: name one in `steps`, "
            'such as "generate_ngram"'
        )
    drafts = drafts_of("ngram", num_speculative_tokens)
    if drafting:
        check_weights(model)
    if draft is not None:
        check_draft(model, draft)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"`max_batch` must be a positive integer, got {max_batch!r}")
    limit = parse_bytes(budget) if budget is not None else None
    if max_seq_len is None and limit is None:
        raise ValueError("give `max_seq_len`, `budget`, or both")
    generator = generator_of(model, draft)
    # What the steps run: the model, or the model and its draft model.
    model = model if draft is None else (model, draft)

    def key(seq: int) -> tuple:
        chunk = min(prefill_chunk or DEFAULT_PREFILL_CHUNK, seq)
        return max_batch, seq, chunk, tuple(steps), drafts

    def make(seq: int) -> Plan:
        built = Plan.build(generator, model, max_batch, seq, key(seq)[2], limit, steps, drafts)
        generator.bills[key(seq)] = built.total_bytes
        return built

    def known() -> list[tuple[int, int]]:
        # `(pages, bill)` of the plans of whole pages built before with these rows and steps.
        built = list(generator.bills.items())
        return [
            (k[1] // SEQ_STEP, bill) for k, bill in built if k == key(k[1]) and k[1] % SEQ_STEP == 0
        ]

    def floor(seq: int) -> int:
        # Weights and scratch, known without compiling: a lower bound of the bill.
        return weights_bytes(model) + _layout(generator, decls, max_batch, seq).device_nbytes

    def over_before_compiling(seq: int) -> PlanError | None:
        # Known without compiling: the weights and the scratch of `seq` tokens are over.
        weights, least = weights_bytes(model), floor(seq)
        if least <= limit:
            return None
        return PlanError(
            f"the plan for `max_batch={max_batch}`, `max_seq_len={seq}` needs "
            f"{format_bytes(least)} before XLA's temporaries (weights {format_bytes(weights)}, "
            f"scratch {format_bytes(least - weights)}), over the budget of {format_bytes(limit)}; "
            f"{_fitting(fit(make, floor, limit, generator.config, known()), max_batch)}"
        )

    decls = generator.declarations(model)
    if generator.partitioner is not None:
        generator.partitioner.check_batch(max_batch)
    if max_seq_len is not None:
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"`max_seq_len` must be an integer >= 2, got {max_seq_len!r}")
        if limit is not None and (refused := over_before_compiling(max_seq_len)):
            raise refused
        p = make(max_seq_len)
        if limit is not None and p.total_bytes > limit:
            fitted = fit(make, floor, limit, generator.config, known())
            raise PlanError(p.over_budget_message(limit, fitted))
        return p
    if refused := over_before_compiling(SEQ_STEP):
        raise refused
    best = fit(make, floor, limit, generator.config, known())
    if best is None:
        raise PlanError(make(SEQ_STEP).over_budget_message(limit, None))
    return best


def _fitting(fitting: Plan | None, max_batch: int) -> str:
    """The end of a refusal: the plan that fits the budget, or that none does."""
    if fitting is None:
        return f"no `max_seq_len` fits at `max_batch={max_batch}`"
    return (
        f"the largest that fits is `max_seq_len={fitting.max_seq_len}` "
        f"({format_bytes(fitting.total_bytes)})"
    )


def _layout(generator: Generator, decls, batch: int, seq: int) -> Layout:
    """The slots of a plan of `batch` rows of `seq` tokens, each row in pages of its own."""
    num_pages, page_size = page_count(batch, seq)
    dims = {"batch": batch, "seq": seq, "num_pages": num_pages, "page_size": page_size}
    return Layout.build(decls, dims, storage_dtype, generator.partitioner)
