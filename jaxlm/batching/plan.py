"""`EnginePlan`: the serving engine's paged KV cache laid out, its steps compiled and its whole
bill known before anything is allocated.

The attention layers declare their pages (`jaxlm.ops.paged_kv_specs`, over the plan dimensions
`num_pages` and `page_size`); the plan binds them, compiles the engine's step for every shape of
prompt chunks it will run (`jaxlm.batching.step`) and reads XLA's memory analysis of each, so
serving never compiles and the bill holds weights, pages and XLA's temporaries. With a
`budget`, it gives the pages what the rest of the bill leaves.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxlm.batching import step
from jaxlm.bill import Bill
from jaxlm.errors import PlanError
from jaxlm.memory import ExecutableMemory, Layout, declarations, format_bytes, parse_bytes
from jaxlm.ops import storage_dtype
from jaxlm.requests import is_int
from jaxlm.sharding import Partitioner, check_data_divides, mesh_of, weights_bytes
from jaxlm.speculative import check_draft, check_weights, drafts_of

# Page 0 pads every table (`jaxlm.batching.pages.PADDING_PAGE`), so a plan has at least two.
MIN_PAGES = 2


class EnginePlan(Bill):
    """The pages and compiled steps of an `LLMEngine`, and their bill.

    Attributes: `max_num_seqs`, `max_seq_len` (the most tokens one sequence holds),
    `page_size`, `num_pages` (page 0 pads), `pages_per_seq`, `max_num_batched_tokens`,
    `decode_steps`, `speculative` (`"ngram"` where a step verifies drafts by prompt lookup,
    the draft model where it drafts with one), `num_speculative_tokens` (the drafts a step
    verifies; 0 without), `layout` (the page slots: a draft model's beside the model's),
    `compiled` (the step of each `Shape`: prompt chunks and their width, `Shape(0, 0)` for
    decode tokens alone, `Shape(0, 0, drafts)` with drafts, and the same over the first slot's
    row alone, `rows=1`), `executables` (XLA's memory analysis of each), `weights_bytes`,
    `scratch_bytes` (the pages), `temp_bytes`, `total_bytes` (the peak of the most demanding
    step, weights and pages included) and `budget`; the weights and pages are the model's and
    its draft model's. On a mesh (`mesh` is not None), the pages split by KV head over `model`
    and every byte count is per device; over `data`, the slots and pages split evenly into
    `shards`, each a pool of its own (whose page 0 pads).
    """

    def __init__(self, model, steps, layout, compiled, budget, partitioner, draft=None):
        self.model = model
        self.draft = draft
        self.steps = steps
        self.layout = layout
        self.compiled = compiled
        self.executables = {s: ExecutableMemory.of(str(s), e) for s, e in compiled.items()}
        self.weights_bytes = weights_bytes(self.models)
        self.budget = budget
        self.partitioner = partitioner
        self.mesh = partitioner.mesh if partitioner else None
        self.num_pages = layout.dims["num_pages"]
        self.page_size = layout.dims["page_size"]
        self.shards = steps.shards
        self.max_num_seqs = steps.rows * steps.shards
        self.pages_per_seq = steps.pages_per_seq
        self.max_num_batched_tokens = steps.buckets[-1]
        self.decode_steps = steps.decode_steps
        self.num_speculative_tokens = steps.drafts
        self.speculative = draft if draft is not None else "ngram" if steps.drafts else None

    @property
    def models(self):
        """What the steps take the weights of: the model, or the model and its draft model as a
        pair (one variable that both hold counts once)."""
        return _models(self.model, self.draft)

    @property
    def max_seq_len(self) -> int:
        """The most tokens one sequence holds: its pages, or every usable page."""
        return min(self.pages_per_seq, self.num_pages // self.shards - 1) * self.page_size

    def allocate(self) -> dict:
        """The pages, zero-filled: exactly `scratch_bytes` (per device), allocated once."""
        return self.layout.allocate()

    def _header(self) -> str:
        return (
            f"EnginePlan: max_num_seqs={self.max_num_seqs}, num_pages={self.num_pages} of "
            f"page_size={self.page_size} ({(self.num_pages - self.shards) * self.page_size} "
            f"tokens{f' in {self.shards} pools' if self.shards > 1 else ''}; a "
            f"sequence holds {self.max_seq_len}), max_num_batched_tokens="
            f"{self.max_num_batched_tokens}, {self._where(self.partitioner)}"
        )

    def __repr__(self) -> str:
        per_device = "" if self.mesh is None else f" per device on {self.mesh.size}"
        return (
            f"EnginePlan(max_num_seqs={self.max_num_seqs}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, total={format_bytes(self.total_bytes)}{per_device})"
        )


def _models(model, draft):
    return model if draft is None else (model, draft)


def _positive(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


def plan_engine(
    model: nnx.Module,
    *,
    max_num_seqs: int,
    max_seq_len: int | None = None,
    page_size: int | None = None,
    num_pages: int | None = None,
    budget: int | str | None = None,
    max_num_batched_tokens: int | None = None,
    decode_steps: int | None = None,
    speculative: str | nnx.Module | None = None,
    num_speculative_tokens: int | None = None,
) -> EnginePlan:
    """The plan of an engine of `max_num_seqs` sequences; see `jaxlm.plan`."""
    drafts = drafts_of(speculative, num_speculative_tokens, draft_models=True)
    if drafts:
        check_weights(model)
    draft = speculative if isinstance(speculative, nnx.Module) else None
    if draft is not None:
        check_draft(model, draft)
    page_size = 16 if page_size is None else page_size
    max_num_batched_tokens = 256 if max_num_batched_tokens is None else max_num_batched_tokens
    decode_steps = 4 if decode_steps is None else decode_steps
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("page_size", page_size),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("decode_steps", decode_steps),
    ):
        _positive(name, value)
    if num_pages is not None and budget is not None:
        raise ValueError("give `num_pages` or `budget`, not both")
    if num_pages is None and budget is None and max_seq_len is None:
        raise ValueError(
            "give `num_pages`, `budget` or `max_seq_len` (pages for every sequence at its longest)"
        )
    config = model.config
    max_seq_len = config.max_position_embeddings if max_seq_len is None else max_seq_len
    _positive("max_seq_len", max_seq_len)
    graphdef, state = nnx.split(_models(model, draft))
    mesh = mesh_of(state)
    shards = mesh.shape.get("data", 1) if mesh is not None else 1
    # Over `data`, each shard's slots own its pages.
    pages_axis = "data" if shards > 1 else None
    partitioner = None
    if mesh is not None:
        draft_config = None if draft is None else draft.config
        partitioner = Partitioner(mesh, config, pages=pages_axis, draft=draft_config)
    least = MIN_PAGES * shards
    if num_pages is not None and (not is_int(num_pages) or num_pages < least):
        raise ValueError(f"`num_pages` must be an integer >= {least}, got {num_pages!r}")
    check_data_divides("max_num_seqs", max_num_seqs, shards)
    if num_pages is None and budget is None:
        # Every sequence at its longest, so none is ever preempted, and each shard's padding.
        num_pages = shards + max_num_seqs * -(-max_seq_len // page_size)
    check_data_divides("num_pages", num_pages or 0, shards)
    decls = list(declarations(model))
    if draft is not None:
        decls += declarations(draft, prefix=("draft",))

    def layout(pages: int) -> Layout:
        dims = {"num_pages": pages, "page_size": page_size}
        return Layout.build(decls, dims, storage_dtype, partitioner)

    steps = step.Steps(
        graphdef,
        rows=max_num_seqs // shards,
        pages_per_seq=-(-max_seq_len // page_size),
        page_size=page_size,
        vocab_size=config.vocab_size,
        buckets=step.buckets(max_num_batched_tokens),
        decode_steps=decode_steps,
        pages_sharding=layout(least).tree(lambda s: s.sharding) if partitioner else None,
        drafts=drafts,
        draft_cost=None if draft is None else weights_bytes(draft) / weights_bytes(model),
        mesh=mesh,
    )
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if mesh else None),
        state,
    )

    limit = parse_bytes(budget) if budget is not None else None

    def make(pages: int, shapes=None) -> EnginePlan:
        lay = layout(pages)
        compiled = steps.compile(abstract, lay.abstract(), shapes)
        return EnginePlan(model, steps, lay, compiled, limit, partitioner, draft)

    if limit is None:
        return make(num_pages)
    # The pages are the only part of the bill that grows with their number. The steps whose
    # temporaries are the largest as a rule (`_probes`), compiled alone with the fewest pages,
    # give the rest of the bill; the pages take what that leaves, then as many fewer as another
    # step's larger temporaries need. Over `data`, pages come a shard's page at a time.
    page_bytes = layout(shards).device_nbytes
    weights = weights_bytes(_models(model, draft))
    if weights + MIN_PAGES * page_bytes > limit:
        raise PlanError(
            f"`budget` {format_bytes(limit)} does not hold the weights, "
            f"{format_bytes(weights)}, and {MIN_PAGES} pages of {format_bytes(page_bytes)}"
        )
    probe = make(least, _probes(steps))
    rest = probe.total_bytes - probe.scratch_bytes
    pages = (limit - rest) // page_bytes
    if pages < MIN_PAGES:
        raise PlanError(
            f"`budget` {format_bytes(limit)} is below the engine's bill without pages, "
            f"{format_bytes(rest)} (weights {format_bytes(probe.weights_bytes)}, XLA "
            f"temporaries {format_bytes(probe.temp_bytes)}), plus {MIN_PAGES} pages of "
            f"{format_bytes(page_bytes)}"
        )
    plan = make(pages * shards)
    over = -(-(plan.total_bytes - limit) // page_bytes)
    if 0 < over <= pages - MIN_PAGES:
        plan = make((pages - over) * shards)
    if plan.total_bytes > limit:
        raise PlanError(
            f"the engine's plan with {plan.num_pages} pages needs {format_bytes(plan.total_bytes)} "
            f"(weights {format_bytes(plan.weights_bytes)}, pages "
            f"{format_bytes(plan.scratch_bytes)}, XLA temporaries "
            f"{format_bytes(plan.temp_bytes)}), over the `budget` of {format_bytes(limit)}"
        )
    return plan


def _probes(steps: step.Steps) -> list[step.Shape]:
    """The steps whose temporaries are the largest as a rule: the prompt chunks of the most
    tokens (the most chunks among them attend over their own pages, through XLA or natively on
    a CPU, the widest over its pages laid end to end: either may hold the most), and decode over
    every row (its sampling holds a row of the vocabulary each)."""
    shapes = list(steps.layouts)
    most = max(s.chunks * s.width for s in shapes)
    chunks = [s for s in shapes if s.width and s.chunks * s.width == most]
    return [*chunks, *(s for s in shapes if not s.width and not s.rows)]
