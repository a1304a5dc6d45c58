"""The engine's jitted steps over the paged KV cache, and what they take from the host and give
back.

A step runs one token of each of its rows and, in steps that have them, chunks of prompts of
several sequences padded to one of a few widths, as many as a power of two up to what
`max_num_batched_tokens` holds at that width (`Shape`), samples the next token of every row
that has reached its end, and returns the pages updated in place. A step of decode tokens alone
(`Shape(0, 0)`) runs up to `decode_steps` steps in a `while_loop`, each feeding back the tokens
it sampled; with prompt-lookup drafts (`Shape(0, 0, drafts)`, `jaxlm.batching.loop`), a step
may also run one row's last token and drafts as a chunk beside the others' tokens. While only
the first slot runs, decode steps run that row alone (`Shape(0, 0, drafts, rows=1)`): a step of
every slot's column costs one sequence twice what its own column does.

A step's host inputs travel as one byte buffer (`HostPack`) and its outputs come back as one
int32 array: each array a call takes from the host or gives back makes the calling thread give
up the GIL and wait to take it again, for up to the switch interval when another thread holds
it (`docs/performance.md`, "The engine's thread and the GIL").

On a mesh with a `data` axis, the slots split over it: each shard of `data` runs the step over
its own rows and its own pages (a `shard_map`, the `model` axis left to XLA), from its own row
of the input buffer, and the shards' outputs come back side by side, rows in slot order.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm.batching import loop
from jaxlm.batching.hostpack import HostPack, zeros
from jaxlm.batching.loop import forward
from jaxlm.batching.sampled import MAX_LOGIT_BIAS, pack, sample
from jaxlm.batching.scheduler import Batch, SequenceState
from jaxlm.generator import SAMPLING_FIELDS, compile_side_by_side
from jaxlm.requests import Request

_SAMPLING_DTYPES = {"top_k": np.int32}
# A step with drafts takes these of each row.
_DRAFT_COUNTS = ("limit", *loop.COUNTS)


class Shape(NamedTuple):
    """A step's shape: `chunks` prompt chunks of `width` tokens each (0 and 0: decode alone;
    with `drafts`, decode that verifies that many drafted tokens at a time), over every slot's
    row or, with `rows`, over the first `rows` slots alone (decode steps)."""

    chunks: int
    width: int
    drafts: int = 0
    rows: int = 0

    def __str__(self) -> str:
        of = f" of {self.rows} row{'s' if self.rows > 1 else ''}" if self.rows else ""
        if self.drafts:
            return f"decode{of} with {self.drafts} drafts"
        if not self.width:
            return f"decode{of}"
        return f"chunk of {self.width}" + (f" x{self.chunks}" if self.chunks > 1 else "")


class Steps:
    """The steps of an engine of `rows` sequences a shard, by `Shape`: their input layouts,
    compiled executables, inputs and outputs. On a `mesh` whose `data` axis has several devices,
    each of them runs `rows` sequences of its own (`shards`)."""

    def __init__(
        self,
        graphdef,
        *,
        rows,
        pages_per_seq,
        page_size,
        vocab_size,
        buckets,
        decode_steps,
        pages_sharding,
        drafts=0,
        draft_cost=None,
        mesh=None,
    ):
        # With a draft model (`draft_cost`, its bytes over the model's: `loop.busiest`),
        # `graphdef` is of the model and the draft model, as a pair.
        self._graphdef, self.draft_cost = graphdef, draft_cost
        self.mesh = mesh
        self.shards = mesh.shape.get("data", 1) if mesh is not None else 1
        if self.shards > 1:
            # Within a shard, its pages keep their split over `model`.
            pages_sharding = jax.tree.map(
                lambda s: NamedSharding(s.mesh, P(None, *s.spec[1:])), pages_sharding
            )
        # On a mesh, the pages a step returns keep the shardings they came in with: XLA aliases
        # a donated buffer to an output only if both are split alike.
        self._pin = (
            (lambda pages: pages)
            if pages_sharding is None
            else (lambda pages: jax.lax.with_sharding_constraint(pages, pages_sharding))
        )
        self.rows, self.pages_per_seq, self.vocab_size = rows, pages_per_seq, vocab_size
        self.page_size, self.buckets, self.decode_steps = page_size, buckets, decode_steps
        self.drafts = drafts
        self.chunk_shapes = {w: min(rows, buckets[-1] // w) for w in buckets}
        shapes = [Shape(0, 0)]
        for width, most in self.chunk_shapes.items():
            # Powers of two below the most: padding at most doubles a step's chunks.
            counts = [1 << i for i in range((most - 1).bit_length())]
            shapes += [Shape(k, width) for k in (*counts, most)]
        if drafts:
            shapes.append(Shape(0, 0, drafts))
        # A lone sequence's decode steps over its own row (the lowest free slot goes first).
        self.narrow = 1 if rows > 1 else 0
        if self.narrow:
            shapes.append(Shape(0, 0, 0, self.narrow))
            if drafts:
                shapes.append(Shape(0, 0, drafts, self.narrow))
        self.layouts = {shape: HostPack(self._spec(shape)) for shape in shapes}
        # A step's inputs where no row asks for them, made once.
        self._unseen = np.zeros((rows, vocab_size), bool)
        self._uncounted = np.zeros((rows, vocab_size), np.int32)
        self._unbiased = (
            np.full((rows, MAX_LOGIT_BIAS), vocab_size, np.int32),
            np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
        )
        self._unmasked = np.zeros((rows, self.mask_words), np.int32)

    @property
    def mask_words(self) -> int:
        """The int32 words of a row's token bitmask: one bit per vocabulary entry, as
        `llguidance` fills it."""
        return -(-self.vocab_size // 32)

    def _spec(self, shape: Shape) -> dict:
        sds = jax.ShapeDtypeStruct
        rows, vocab = shape.rows or self.rows, self.vocab_size

        def tokens(r, c):
            return dict(
                input_ids=sds((r, c), jnp.int32),
                positions=sds((r, c), jnp.int32),
                table=sds((r, self.pages_per_seq), jnp.int32),
                last=sds((r,), jnp.int32),
            )

        spec = dict(
            decode=tokens(rows, 1),
            params={n: sds((rows,), _SAMPLING_DTYPES.get(n, jnp.float32)) for n in SAMPLING_FIELDS},
            keys=sds((rows, 2), jnp.uint32),
            generated=sds((rows,), jnp.int32),
            seen=sds((rows, vocab), jnp.bool_),
            # The counts of each row's generated tokens that OpenAI's penalties read, and its
            # `logit_bias`.
            penalties=dict(presence=sds((rows,), jnp.float32), frequency=sds((rows,), jnp.float32)),
            counts=sds((rows, vocab), jnp.int32),
            bias_ids=sds((rows, MAX_LOGIT_BIAS), jnp.int32),
            bias=sds((rows, MAX_LOGIT_BIAS), jnp.float32),
            # Whether any row carries a grammar: without one, the mask is not read.
            masked=sds((), jnp.bool_),
            mask=sds((rows, self.mask_words), jnp.int32),
            logprobs=sds((), jnp.bool_),
        )
        if shape.width:
            spec["chunk"] = {
                **tokens(shape.chunks, shape.width),
                "rows": sds((shape.chunks,), jnp.int32),
            }
        else:
            spec["steps"] = sds((), jnp.int32)
            spec["stops"] = sds((rows, vocab), jnp.bool_)
        if shape.drafts:
            # Each row's tokens, whether it drafts, the slots its pages hold, and its
            # `SequenceState.draft_wait`, `draft_backoff` and `draft_len`.
            spec["history"] = sds((rows, self.pages_per_seq * self.page_size), jnp.int32)
            spec["drafting"] = sds((rows,), jnp.bool_)
            spec.update({n: sds((rows,), jnp.int32) for n in _DRAFT_COUNTS})
        return spec

    def compile(self, state, pages, shapes=None) -> dict:
        """Each `Shape`'s step (of `shapes`, or all), compiled for the model's `state` and the
        `pages` (shapes will do); it takes `(state, pages, buffer)`, donates the pages and
        returns `(pages, out)`."""
        lowered = {}
        for shape in self.layouts if shapes is None else shapes:
            layout = self.layouts[shape]
            run = functools.partial(self._run if shape.width else self._run_decode, layout)
            spec = layout.spec
            if self.shards > 1:
                run = self._over_shards(run)
                replicated = NamedSharding(self.mesh, P())
                spec = jax.ShapeDtypeStruct(
                    (self.shards, *spec.shape), spec.dtype, sharding=replicated
                )
            fn = jax.jit(run, donate_argnums=1)
            lowered[shape] = fn.lower(state, pages, spec)
        return compile_side_by_side(lowered)

    def _together(self, p):
        # The model's collectives in a loop wait for every shard (`loop.decode`).
        if self.shards == 1:
            return p
        return jax.lax.psum(p.astype(jnp.int32), "data") > 0

    def _over_shards(self, run):
        # The input buffer, a row a shard, and the output stay whole on every device, so that
        # every process of a mesh over several writes and reads them as on one.
        def local(state, pages, buf):
            pages, out = run(state, pages, buf[jax.lax.axis_index("data")])
            return pages, jax.lax.all_gather(out, "data", axis=1, tiled=True)

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(), P("data"), P()),
            out_specs=(P("data"), P()),
            axis_names={"data"},
            check_vma=False,
        )

    # The steps.

    def _models(self, state):
        """The model and the draft model (None without one)."""
        models = nnx.merge(self._graphdef, state)
        return models if self.draft_cost is not None else (models, None)

    def _run(self, layout, state, pages, buf):
        # One token of each row and prompt chunks of some rows, as two groups of their own
        # widths: padding every row to the chunks' width would multiply the work of a step by
        # its rows.
        x = layout.unpack(buf)
        rows = x["chunk"].pop("rows")
        model = self._models(state)[0]
        (logits, chunk_logits), pages = forward(model, [x["decode"], x["chunk"]], pages)
        # A padding chunk's row is `rows`, out of range: its logits are dropped.
        logits = logits.at[rows].set(chunk_logits, mode="drop")
        sampled = sample(logits, x, x["generated"], lambda: x["seen"], lambda: x["counts"])
        return self._pin(pages), pack(sampled)[None]

    def _run_decode(self, layout, state, pages, buf):
        # Up to `steps` decode steps, each feeding back the tokens it sampled, until a row
        # samples one of its `stops` [rows, vocab]; with drafts, rows run ahead where they draft.
        x = layout.unpack(buf)
        decode = x["decode"]
        drafts = self.drafts if "history" in x else 0
        rows, most = decode["positions"].shape[0], self.decode_steps + drafts
        c = loop.carry(
            pages,
            decode["input_ids"][:, 0],
            decode["positions"][:, 0],
            seen=x["seen"],
            counts=x["counts"],
            drafts=drafts,
            carried={name: x[name] for name in loop.COUNTS} if drafts else None,
            history=x["history"] if drafts else None,
            out=loop.new_out(rows, most),
        )
        c = loop.decode(
            self._models(state),
            x,
            c,
            drafts=drafts,
            most=most,
            draft_cost=self.draft_cost or 0.0,
            together=self._together,
        )
        return self._pin(c["pages"]), loop.out_of(c, most)

    # The host's side.

    def inputs(
        self,
        batch: Batch,
        requests: Mapping[int, Request],
        logprobs: set[int],
        mask: np.ndarray | None = None,
        drafting: set[int] = frozenset(),
    ):
        """The `Shape` of `batch`'s step and its inputs packed, given each sequence's `Request`
        by id, the ids that want log-probabilities, where a row carries a grammar, the token
        bitmask of every row [rows x shards, `mask_words`] (all bits set in rows without one,
        by `row`), and the ids that may draft (in a step of decode tokens alone, on `Steps` made
        with `drafts`)."""
        shards = [[c for c in batch.chunks if c.seq.shard == d] for d in range(self.shards)]
        prefills = [[c for c in chunks if len(c.tokens) > 1] for chunks in shards]
        shape = self.shape([c for p in prefills for c in p], max(map(len, prefills)))
        if not shape.width:
            if self.drafts and drafting:
                shape = Shape(0, 0, self.drafts)
            if self.narrow and all(c.seq.slot < self.narrow for c in batch.chunks):
                shape = shape._replace(rows=self.narrow)
        rows = self.rows
        x = dict(
            logprobs=np.bool_(any(c.sample and c.seq.id in logprobs for c in batch.chunks)),
            masked=np.bool_(mask is not None),
        )
        xs = [
            self._shard_inputs(
                chunks,
                chunk_rows,
                shape,
                batch.steps,
                requests,
                {**x, "mask": self._unmasked if mask is None else mask[d * rows : (d + 1) * rows]},
                drafting,
            )
            for d, (chunks, chunk_rows) in enumerate(zip(shards, prefills, strict=True))
        ]
        return shape, self.layouts[shape].pack(*xs)

    def row(self, seq: SequenceState, shape: Shape | None = None) -> int:
        """The row of `seq` in the output of a step of `shape`, and without one, in a mask of
        every row."""
        return seq.shard * ((shape and shape.rows) or self.rows) + seq.slot

    def _shard_inputs(self, chunks, prefills, shape, steps, requests, x, drafting) -> dict:
        """The inputs of one shard's rows: its `chunks`, of which `prefills` are prompt chunks,
        in a step of `shape`, with the `x` they share."""
        rows, per_seq = self.rows, self.pages_per_seq
        seen, counts = self._unseen, self._uncounted
        penalties = {n: np.zeros((rows,), np.float32) for n in ("presence", "frequency")}
        bias_ids, bias = self._unbiased
        decode = dict(
            input_ids=np.zeros((rows, 1), np.int32),
            positions=np.full((rows, 1), -1, np.int32),
            table=np.zeros((rows, per_seq), np.int32),
            last=np.zeros((rows,), np.int32),
        )
        params = {
            n: np.zeros((rows,), _SAMPLING_DTYPES.get(n, np.float32)) for n in SAMPLING_FIELDS
        }
        params["top_p"][:] = 1.0
        keys = np.zeros((rows, 2), np.uint32)
        generated = np.zeros((rows,), np.int32)
        for c in chunks:
            seq, n, r = c.seq, len(c.tokens), c.seq.slot
            if n == 1:
                decode["input_ids"][r, 0] = c.tokens[0]
                decode["positions"][r, 0] = c.start
                decode["table"][r, : len(seq.pages)] = seq.pages
            req = requests[seq.id]
            for name in SAMPLING_FIELDS:
                params[name][r] = req.sampling[name][0]
            # The key of a one-prompt `generate`'s only row.
            keys[r] = (req.params.seed & 0xFFFFFFFF, 0)
            generated[r] = len(seq.output)
            if c.sample and params["repetition_penalty"][r] != 1.0:
                # The prompt and every token generated so far, as `generate` penalizes them.
                if seen is self._unseen:
                    seen = np.zeros_like(self._unseen)
                seen[r, seq.tokens] = True
            penalties["presence"][r] = req.params.presence_penalty
            penalties["frequency"][r] = req.params.frequency_penalty
            if (
                c.sample
                and (req.params.presence_penalty or req.params.frequency_penalty)
                and seq.output
            ):
                if counts is self._uncounted:
                    counts = np.zeros_like(self._uncounted)
                counts[r] = np.bincount(seq.output, minlength=self.vocab_size)
            if req.logit_bias:
                if bias is self._unbiased[1]:
                    bias_ids, bias = (a.copy() for a in self._unbiased)
                bias_ids[r], bias[r] = req.bias_row(self.vocab_size)
        x = dict(x, decode=decode, params=params, keys=keys, generated=generated, seen=seen)
        x.update(penalties=penalties, counts=counts, bias_ids=bias_ids, bias=bias)
        if shape.width:
            x["chunk"] = self._chunks(prefills, shape)
            return x
        x["steps"] = np.int32(steps)
        x["stops"] = zeros((rows, self.vocab_size), bool)
        for c in chunks:
            x["stops"][c.seq.slot, sorted(requests[c.seq.id].stop_ids)] = True
        if shape.drafts:
            x.update(self._history(chunks, drafting))
        if shape.rows:
            x = jax.tree.map(lambda a: a[: shape.rows] if np.ndim(a) else a, x)
        return x

    def _history(self, chunks, drafting: set[int]) -> dict:
        """Each row's tokens, whether it may draft, the slots its pages hold, and its
        `SequenceState.draft_wait`, `draft_backoff` and `draft_len`."""
        rows = self.rows
        out = dict(
            history=zeros((rows, self.pages_per_seq * self.page_size)),
            drafting=np.zeros((rows,), bool),
            **{n: np.zeros((rows,), np.int32) for n in _DRAFT_COUNTS},
        )
        for c in chunks:
            seq, r = c.seq, c.seq.slot
            out["history"][r, : len(seq.prompt)] = seq.prompt
            out["history"][r, len(seq.prompt) : seq.num_tokens] = seq.output
            out["drafting"][r] = seq.id in drafting
            out["limit"][r] = len(seq.pages) * self.page_size
            out["wait"][r], out["backoff"][r] = seq.draft_wait, seq.draft_backoff
            out["draft_len"][r] = seq.draft_len
        return out

    def shape(self, chunks, most: int | None = None) -> Shape:
        """The smallest `Shape` that runs the prompt `chunks` (of several tokens each), `most`
        of them (all by default) on the shard that runs the most."""
        if not chunks:
            return Shape(0, 0)
        most = len(chunks) if most is None else most
        width = next(w for w in self.buckets if w >= max(len(c.tokens) for c in chunks))
        fits = [s for s in self.layouts if s.width == width and s.chunks >= most]
        if not fits:
            raise ValueError(
                f"{most} prompt chunks of up to {width} tokens in one step: at most "
                f"{self.chunk_shapes[width]} at that width"
            )
        return min(fits)

    def _chunks(self, chunks, shape: Shape) -> dict:
        """The prompt `chunks` as the rows of a group of `shape`, padded to its width; padding
        rows sample into row `rows`, which does not exist."""
        k, width = shape.chunks, shape.width
        out = dict(
            input_ids=np.zeros((k, width), np.int32),
            positions=np.full((k, width), -1, np.int32),
            table=np.zeros((k, self.pages_per_seq), np.int32),
            last=np.zeros((k,), np.int32),
            rows=np.full((k,), self.rows, np.int32),
        )
        for i, c in enumerate(chunks):
            n, pages = len(c.tokens), c.seq.pages
            out["input_ids"][i, :n] = c.tokens
            out["positions"][i, :n] = np.arange(c.start, c.start + n)
            out["table"][i, : len(pages)] = pages
            out["last"][i], out["rows"][i] = n - 1, c.seq.slot
        return out


def buckets(max_tokens: int) -> tuple[int, ...]:
    """The widths of a step's prompt chunk: 16, 32, 64, ... up to `max_tokens`."""
    widths, width = [], 16
    while width < max_tokens:
        widths.append(width)
        width *= 2
    return (*widths, max_tokens)
