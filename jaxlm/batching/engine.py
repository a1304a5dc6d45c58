"""`LLMEngine`: continuous batching of a model's requests over a paged KV cache.

A thread of the engine's own runs steps while requests come and go: `Scheduler.schedule()`
picks each step's decode tokens and prompt chunks, one jitted call runs them over the pages
(`forward_paged`), samples the next token of every sequence that has reached its end, and
returns the pages updated in place. Requests join at the next step and leave when they stop,
so none waits for another to finish.

A step runs one token of each of its `max_num_seqs` rows and, in steps that have one, a chunk
of one sequence's prompt padded to one of a few widths; every variant is compiled when the
engine starts, so serving never compiles. A step of decode tokens alone runs in a `while_loop`
of up to `decode_steps` steps, each feeding back the tokens it sampled, so that the engine's
thread comes back to Python (and takes the GIL) once for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm import ops, sampling
from jaxlm.batching.pages import PagePool
from jaxlm.batching.scheduler import Batch, Scheduler, SequenceState
from jaxlm.engine import SAMPLING_FIELDS, weights_bytes
from jaxlm.memory import ExecutableMemory, format_bytes, parse_bytes
from jaxlm.requests import Detokenizer, cut_at_stop, is_int, parse_request
from jaxlm.sharding import mesh_of

_DONE = object()
_SAMPLING_DTYPES = {"top_k": np.int32}
# The most alternatives a request can ask log-probabilities of, as OpenAI allows.
TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the `top` most likely tokens' at its step as
    `(token_id, logprob)` pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its text (None without a tokenizer), token ids and why it ended
    (`"stop"`, `"length"` or `"cancelled"`); with `logprobs=` at submit, one `TokenLogprob` per
    token."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Delta:
    """What a request produced since the last `RequestHandle.deltas()`: new text, the tokens
    sampled meanwhile and their log-probabilities (None unless asked for)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's counters (`LLMEngine.stats()`): the requests running and
    waiting, the pages in use, free and held by the prefix cache, and totals since it started."""

    running: int
    waiting: int
    pages_total: int
    pages_in_use: int
    pages_free: int
    pages_cached: int
    steps: int
    # A call runs up to `decode_steps` steps of decode tokens alone.
    calls: int
    prefill_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    preemptions: int
    finished: int


class RequestHandle:
    """A submitted request: iterate it for its text as it is generated, or wait for `result()`.

    Example:
        >>> handle = engine.submit("Once upon a time", max_new_tokens=32)
        >>> for piece in handle:
        ...     print(piece, end="")
        >>> handle.result().finish_reason

    A program on an event loop passes `on_update` to `submit` instead: the engine's thread calls
    it whenever there is something new, and `deltas()` takes it without waiting.
    """

    def __init__(
        self, engine: LLMEngine, seq: SequenceState, req, tokenizer, top_logprobs, on_update
    ):
        self._engine = engine
        self.seq = seq
        self._req = req
        self._tokenizer = tokenizer
        self._pieces: queue.Queue = queue.Queue()
        self._detokenizer = Detokenizer(tokenizer, req.stop) if tokenizer is not None else None
        self._done = threading.Event()
        self._result: RequestOutput | None = None
        self._error: BaseException | None = None
        self._on_update = on_update
        self._deltas: list[Delta] = []
        self._sent = 0  # tokens handed out in deltas so far
        self._top = top_logprobs
        self.logprobs: list[TokenLogprob] | None = None if top_logprobs is None else []
        # When each token arrived (`time.perf_counter()`), for latency figures.
        self.token_times: list[float] = []

    def _tokens(self) -> list[int]:
        ids = list(self.seq.output)
        if ids and ids[-1] in self._req.stop_ids:
            ids.pop()
        return ids

    def _add_logprobs(self, chosen, ids, top) -> None:
        pairs = tuple(zip(ids[: self._top].tolist(), top[: self._top].tolist(), strict=True))
        self.logprobs.append(TokenLogprob(self.seq.output[-1], float(chosen), pairs))

    def _step(self, finished: bool) -> bool:
        """Take the sequence's new tokens; whether a stop string ended it."""
        ids = self._tokens()
        if self._detokenizer is None:
            self._emit("", ids)
            if finished:
                self._finish(None, ids, self.seq.finish_reason)
            return False
        piece = self._detokenizer.update(ids, final=finished)
        if piece:
            self._pieces.put(piece)
        stopped = self._detokenizer.finished and not finished
        if finished or stopped:
            text, ids, cut = cut_at_stop(self._tokenizer, ids, self._req.stop)
            self._emit(piece, ids)
            self._finish(text, ids, "stop" if cut or stopped else self.seq.finish_reason)
        elif piece:
            self._emit(piece, ids)
        return stopped

    def _emit(self, text: str, ids: list[int]) -> None:
        new = ids[self._sent :]
        if not text and not new:
            return
        logprobs = None if self.logprobs is None else self.logprobs[self._sent : len(ids)]
        self._deltas.append(Delta(text, new, logprobs))
        self._sent = max(self._sent, len(ids))
        if self._on_update is not None:
            self._on_update()

    def _finish(self, text, ids, reason) -> None:
        logprobs = None if self.logprobs is None else self.logprobs[: len(ids)]
        self._result = RequestOutput(text, ids, reason, list(self.seq.prompt), logprobs)
        self._pieces.put(_DONE)
        self._done.set()
        if self._on_update is not None:
            self._on_update()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._pieces.put(_DONE)
        self._done.set()
        if self._on_update is not None:
            self._on_update()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def deltas(self) -> list[Delta]:
        """What the request produced since the last call, without waiting; once `done`, the
        `result()` follows the last of them."""
        with self._engine._lock:
            out, self._deltas = self._deltas, []
        return out

    def __iter__(self) -> Iterator[str]:
        while (piece := self._pieces.get()) is not _DONE:
            yield piece
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Stop the request at the next step; its slot and pages are freed."""
        self._engine._cancel(self)


class LLMEngine:
    """Serve a model's requests by continuous batching over a paged KV cache.

    `max_num_seqs` sequences run at once, each up to `max_seq_len` tokens in pages of
    `page_size`; `num_pages` pages in all (page 0 pads), or as many as `budget` leaves beside
    the weights and the steps' temporaries. A step runs at most `max_num_batched_tokens` tokens.
    Decode steps run `decode_steps` at a time while no prompt waits, ending early where a
    request samples a stop token: the tokens of a call reach its requests together.

    Example:
        >>> engine = jaxlm.LLMEngine(model, tokenizer, max_num_seqs=4, budget="1GiB")
        >>> handles = [engine.submit(p, max_new_tokens=32) for p in prompts]
        >>> [h.result().text for h in handles]
        >>> engine.close()
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_num_seqs: int = 4,
        max_seq_len: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        budget: int | str | None = None,
        max_num_batched_tokens: int = 256,
        prefix_cache: bool = True,
        max_queue: int = 1024,
        decode_steps: int = 4,
    ):
        if not is_int(decode_steps) or decode_steps < 1:
            raise ValueError(f"`decode_steps` must be a positive integer, got {decode_steps!r}")
        if (num_pages is None) == (budget is None):
            raise ValueError("give one of `num_pages` and `budget`")
        if mesh_of(nnx.state(model)) is not None:
            raise ValueError(
                "`LLMEngine` runs a model on one device; load it without `mesh` (a sharded "
                "or multi-host engine is not built yet)"
            )
        self.model, self.tokenizer = model, tokenizer
        config = model.config
        max_seq_len = max_seq_len or config.max_position_embeddings
        self.page_size = page_size
        self.pages_per_seq = -(-max_seq_len // page_size)
        self.max_num_seqs = max_num_seqs
        self.buckets = _buckets(max_num_batched_tokens)
        self._graphdef, self._state = nnx.split(model)
        self.decode_steps = decode_steps
        self._step = jax.jit(self._run, donate_argnums=1)
        self._decode = jax.jit(self._run_decode, donate_argnums=1)
        if budget is not None:
            limit = parse_bytes(budget)
            num_pages = self._pages_within(limit)
        self.compiled = self._compile(num_pages)
        self.executables = {
            w: ExecutableMemory.of(f"chunk of {w}", e) for w, e in self.compiled.items()
        }
        self.weights_bytes = weights_bytes(model)
        self.pages_bytes = num_pages * self._page_bytes()
        if budget is not None and self.total_bytes > limit:
            raise ValueError(
                f"`budget` {format_bytes(limit)} leaves no room for the steps: "
                f"{format_bytes(self.total_bytes)} with {num_pages} pages"
            )
        self.pool = PagePool(num_pages, page_size, prefix_cache=prefix_cache)
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            pages_per_seq=self.pages_per_seq,
            max_queue=max_queue,
            max_prefill_chunks=1,
        )
        self.pages = jax.jit(lambda: self._zeros(num_pages))()
        self._unseen = np.zeros((max_num_seqs, model.config.vocab_size), bool)
        self.steps = 0
        self.calls = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.finished = 0
        self._handles: dict[int, RequestHandle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="jaxlm-engine", daemon=True)
        self._thread.start()

    # Memory.

    def _page_bytes(self) -> int:
        c = self.model.config
        k, _ = ops.paged_kv_shapes(1, self.page_size, c.num_key_value_heads, c.head_dim)
        itemsize = ops.storage_dtype(self.model.dtype).itemsize
        return 2 * c.num_hidden_layers * int(np.prod(k)) * itemsize

    @property
    def total_bytes(self) -> int:
        """The whole bill: the peak of the most demanding step, weights and pages included."""
        return max(e.peak for e in self.executables.values())

    def _pages_within(self, limit: int) -> int:
        # The pages are the only part of the bill that grows with their number: compile once
        # with two pages and give the pages what the rest leaves.
        probe = self._compile(2)
        rest = max(ExecutableMemory.of("probe", e).peak for e in probe.values())
        pages = 2 + (limit - rest) // self._page_bytes()
        if pages < 2:
            raise ValueError(
                f"`budget` {format_bytes(limit)} is below the bill without pages, "
                f"{format_bytes(rest)}"
            )
        return pages

    def _zeros(self, num_pages: int) -> dict:
        c = self.model.config
        k, v = ops.paged_kv_shapes(num_pages, self.page_size, c.num_key_value_heads, c.head_dim)
        dtype = ops.storage_dtype(self.model.dtype)
        layer = lambda: {
            "self_attn": {"k_pages": jnp.zeros(k, dtype), "v_pages": jnp.zeros(v, dtype)}
        }
        return {"layers": {i: layer() for i in range(c.num_hidden_layers)}}

    def _compile(self, num_pages: int) -> dict:
        """The step for each prompt chunk width (`0`: decode tokens alone), compiled."""
        pages = jax.eval_shape(lambda: self._zeros(num_pages))
        sds = jax.ShapeDtypeStruct
        rows, per_seq = self.max_num_seqs, self.pages_per_seq

        def tokens(r, c):
            return dict(
                input_ids=sds((r, c), jnp.int32),
                positions=sds((r, c), jnp.int32),
                table=sds((r, per_seq), jnp.int32),
                last=sds((r,), jnp.int32),
            )

        params = {n: sds((rows,), _SAMPLING_DTYPES.get(n, jnp.float32)) for n in SAMPLING_FIELDS}
        seen = sds((rows, self.model.config.vocab_size), jnp.bool_)
        rest = (params, sds((rows, 2), jnp.uint32), sds((rows,), jnp.int32), seen, sds((), bool))
        decode = (self._state, pages, tokens(rows, 1))
        out = {0: self._decode.lower(*decode, *rest, sds((), jnp.int32), seen).compile()}
        for width in self.buckets:
            chunk = {**tokens(1, width), "row": sds((), jnp.int32)}
            out[width] = self._step.lower(*decode, chunk, *rest).compile()
        return out

    # The step.

    def _run(self, state, pages, decode, chunk, params, keys, generated, seen, logprobs):
        # One token of each row and a prompt chunk of one row, as two groups of their own
        # widths: padding every row to the chunk's width would multiply the work of a step by
        # its rows.
        model = nnx.merge(self._graphdef, state)
        row = chunk.pop("row")
        (logits, chunk_logits), pages = model.forward_paged([decode, chunk], pages)
        logits = logits.at[row].set(chunk_logits[0])
        return pages, _pack(_sample(logits, params, keys, generated, seen, logprobs))[None]

    def _run_decode(
        self, state, pages, decode, params, keys, generated, seen, logprobs, steps, stops
    ):
        # Up to `steps` decode steps, each feeding back the tokens it sampled, until a row
        # samples one of its `stops` [rows, vocab]: the engine's thread (and the GIL) comes
        # back once for all of them.
        model = nnx.merge(self._graphdef, state)
        rows = decode["input_ids"].shape[0]
        live = decode["positions"][:, 0] >= 0
        # Steps not run keep token -1 (`_unpack`).
        out = jnp.full((self.decode_steps, rows, _PACKED), -1, jnp.int32)

        def step(carry):
            i, pages, ids, positions, generated, seen, out, _ = carry
            group = {**decode, "input_ids": ids[:, None], "positions": positions[:, None]}
            (logits,), pages = model.forward_paged([group], pages)
            sampled = _sample(logits, params, keys, generated, seen, logprobs)
            token = sampled[0]
            out = out.at[i].set(_pack(sampled))
            stopped = jnp.any(live & stops[jnp.arange(rows), token])
            positions = jnp.where(live, positions + 1, -1)
            seen = seen.at[jnp.arange(rows), token].set(True)
            return i + 1, pages, token, positions, generated + 1, seen, out, stopped

        carry = (
            jnp.int32(0),
            pages,
            decode["input_ids"][:, 0],
            decode["positions"][:, 0],
            generated,
            seen,
        )
        carry = jax.lax.while_loop(
            lambda c: (c[0] < steps) & ~c[-1], step, (*carry, out, jnp.bool_(False))
        )
        return carry[1], carry[6]

    def _inputs(self, batch: Batch) -> tuple[int, tuple]:
        rows, per_seq = self.max_num_seqs, self.pages_per_seq
        seen = self._unseen
        want_logprobs = False
        decode = dict(
            input_ids=np.zeros((rows, 1), np.int32),
            positions=np.full((rows, 1), -1, np.int32),
            table=np.zeros((rows, per_seq), np.int32),
            last=np.zeros((rows,), np.int32),
        )
        chunk, width = None, 0
        params = {
            n: np.zeros((rows,), _SAMPLING_DTYPES.get(n, np.float32)) for n in SAMPLING_FIELDS
        }
        params["top_p"][:] = 1.0
        keys = np.zeros((rows, 2), np.uint32)
        generated = np.zeros((rows,), np.int32)
        for c in batch.chunks:
            seq, n, r = c.seq, len(c.tokens), c.seq.slot
            if n == 1:
                decode["input_ids"][r, 0] = c.tokens[0]
                decode["positions"][r, 0] = c.start
                decode["table"][r, : len(seq.pages)] = seq.pages
            else:
                width = next(w for w in self.buckets if w >= n)
                chunk = dict(
                    input_ids=np.zeros((1, width), np.int32),
                    positions=np.full((1, width), -1, np.int32),
                    table=np.zeros((1, per_seq), np.int32),
                    last=np.array([n - 1], np.int32),
                    row=np.int32(r),
                )
                chunk["input_ids"][0, :n] = c.tokens
                chunk["positions"][0, :n] = np.arange(c.start, c.start + n)
                chunk["table"][0, : len(seq.pages)] = seq.pages
            req = self._handles[seq.id]._req
            for name in SAMPLING_FIELDS:
                params[name][r] = req.sampling[name][0]
            # The key of a one-prompt `generate`'s only row.
            keys[r] = (req.seed & 0xFFFFFFFF, 0)
            generated[r] = len(seq.output)
            if c.sample and params["repetition_penalty"][r] != 1.0:
                # The prompt and every token generated so far, as `generate` penalizes them;
                # steps without a penalty share one all-false mask.
                if seen is self._unseen:
                    seen = np.zeros_like(self._unseen)
                seen[r, seq.tokens] = True
            want_logprobs |= c.sample and self._handles[seq.id].logprobs is not None
        rest = (params, keys, generated, seen, np.bool_(want_logprobs))
        if chunk is not None:
            return width, (decode, chunk, *rest)
        stops = np.zeros((rows, self.model.config.vocab_size), bool)
        for c in batch.chunks:
            stops[c.seq.slot, sorted(self._handles[c.seq.id]._req.stop_ids)] = True
        return 0, (decode, *rest, np.int32(batch.steps), stops)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self.scheduler.has_work():
                    self._wake.wait()
                if self._closed:
                    return
                batch = self.scheduler.schedule(self.decode_steps)
                if not batch.chunks:
                    continue
                width, inputs = self._inputs(batch)
                rows = {c.seq.id: c.seq.slot for c in batch.chunks if c.sample}
            try:
                self.pages, out = self.compiled[width](self._state, self.pages, *inputs)
                # One array, so the thread gives up the GIL once to wait for the step.
                out = np.asarray(out)
                self.calls += 1
                with self._wake:
                    for step in _unpack(out):
                        tokens = step[0]
                        sampled = {i: int(tokens[r]) for i, r in rows.items()}
                        self._record(batch, sampled, step[1:], rows)
                        batch = self.scheduler.next_steps(batch)
                        rows = {c.seq.id: c.seq.slot for c in batch.chunks}
            except BaseException as error:  # the engine cannot go on: fail every request
                self._fail_all(error)
                return

    def _record(self, batch: Batch, sampled: dict[int, int], logprobs, rows) -> None:
        """Hand a step's tokens to the scheduler and to the requests still waiting for them."""
        now = time.perf_counter()
        self.steps += 1
        self.prefill_tokens += sum(
            max(0, min(c.start + len(c.tokens), len(c.seq.prompt)) - c.start) for c in batch.chunks
        )
        # A request cancelled while the step ran has left: its token is dropped.
        sampled = {i: t for i, t in sampled.items() if i in self._handles}
        self.generated_tokens += len(sampled)
        stop = {i: t in self._handles[i]._req.stop_ids for i, t in sampled.items()}
        finished = {s.id for s in self.scheduler.update(batch, sampled, stop)}
        for i in sampled:
            handle = self._handles[i]
            handle.token_times.append(now)
            if handle.logprobs is not None:
                handle._add_logprobs(*(x[rows[i]] for x in logprobs))
            if handle._step(i in finished):
                self.scheduler.cancel(handle.seq)
            if handle._done.is_set():
                del self._handles[i]
                self.finished += 1

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            for handle in self._handles.values():
                handle._fail(error)
            self._handles.clear()
            self._closed = True

    def describe(self) -> str:
        """The engine's memory bill, from the compiled steps' memory analysis, as text."""
        pages = self.pool.num_usable
        temp = max(e.temp for e in self.executables.values())
        rows = [
            ("weights", format_bytes(self.weights_bytes)),
            (
                "KV pages",
                f"{format_bytes(self.pages_bytes)}: {pages} pages of {self.page_size} tokens "
                f"({pages * self.page_size} tokens; a sequence holds {self.max_seq_len})",
            ),
            ("temporaries", f"{format_bytes(temp)} (the largest step's)"),
            ("total", f"{format_bytes(self.total_bytes)} (the peak of the largest step)"),
            (
                "batch",
                f"{self.max_num_seqs} sequences, up to {self.buckets[-1]} prompt tokens a step "
                f"({len(self.compiled)} compiled steps)",
            ),
        ]
        return "\n".join(f"  {name:<12} {value}" for name, value in rows)

    @property
    def max_seq_len(self) -> int:
        """The most tokens a sequence holds, prompt and generated: its pages, or all of them."""
        return min(self.scheduler.max_tokens_per_seq, self.pool.num_usable * self.page_size)

    @property
    def is_running(self) -> bool:
        """Whether the engine takes requests: not closed, and its thread has not died."""
        return not self._closed and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's counters now (see `EngineStats`)."""
        with self._wake:
            s, pool = self.scheduler, self.pool
            return EngineStats(
                running=len(s.running),
                waiting=len(s.waiting),
                pages_total=pool.num_usable,
                pages_in_use=pool.num_in_use,
                pages_free=pool.num_available,
                pages_cached=pool.num_cached,
                steps=self.steps,
                calls=self.calls,
                prefill_tokens=self.prefill_tokens,
                cached_prompt_tokens=s.cached_tokens,
                generated_tokens=self.generated_tokens,
                preemptions=s.preemptions,
                finished=self.finished,
            )

    # Requests.

    def submit(
        self,
        prompt,
        *,
        max_new_tokens: int,
        temperature=0.0,
        top_k=None,
        top_p=None,
        min_p=None,
        repetition_penalty=None,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        on_update: Callable[[], None] | None = None,
    ) -> RequestHandle:
        """Queue one request (a string or token ids); returns its handle at once.

        The sampling arguments are `jaxlm.generate`'s, for one prompt; a bad one raises
        `ValueError` here, and a full queue `QueueFullError`. `logprobs=k` records each token's
        log-probability and the `k` (at most `TOP_LOGPROBS`) most likely tokens' at its step.
        `on_update` is called from the engine's thread whenever the handle has new deltas or
        has ended; it must not block."""
        if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= TOP_LOGPROBS):
            raise ValueError(
                f"`logprobs` must be an integer in [0, {TOP_LOGPROBS}], got {logprobs!r}"
            )
        req = parse_request(
            self.model,
            self.tokenizer,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            stop_token_ids=stop_token_ids,
            stop=stop,
            plan=None,
        )
        if len(req.prompts) != 1:
            raise ValueError("`submit` takes one prompt; submit each of several on its own")
        req.stop_ids = frozenset(int(t) for t in req.stop_ids if t >= 0)
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            seq = self.scheduler.submit(req.prompts[0], max_new_tokens)
            handle = RequestHandle(self, seq, req, self.tokenizer, logprobs, on_update)
            self._handles[seq.id] = handle
            self._wake.notify()
        return handle

    def generate(self, prompts: Sequence, **kwargs) -> list[RequestOutput]:
        """Submit every prompt and wait for all: `[handle.result() ...]` in their order."""
        handles = [self.submit(p, **kwargs) for p in prompts]
        return [h.result() for h in handles]

    def _cancel(self, handle: RequestHandle) -> None:
        with self._wake:
            if not handle._done.is_set():
                self.scheduler.cancel(handle.seq)
                handle._step(True)
                self._handles.pop(handle.seq.id, None)

    def close(self) -> None:
        """Stop the engine's thread; requests still running end as cancelled."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        for handle in list(self._handles.values()):
            self.scheduler.cancel(handle.seq)
            handle._step(True)
        self._handles.clear()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sample(logits, params, keys, generated, seen, logprobs):
    """Each row's next token, and with `logprobs`, its log-probabilities (else zeros)."""
    penalty = params["repetition_penalty"]
    penalized = jax.lax.cond(
        jnp.any(penalty != 1.0),
        lambda x: sampling.penalize_seen(x, seen, penalty),
        lambda x: x,
        logits,
    )
    # As `generate` keys its rows: a request's `n`-th token from `fold_in(key, n)`.
    keys = jax.vmap(jax.random.fold_in)(keys, generated)
    token = sampling.sample(
        penalized, keys, params["temperature"], params["top_k"], params["top_p"], params["min_p"]
    )
    return token, *jax.lax.cond(logprobs, _logprobs, _no_logprobs, logits, token)


# A step's output per row, packed in one int32 array: the token, its log-probability, the ids
# of the `TOP_LOGPROBS` most likely tokens and their log-probabilities (floats as bits).
_PACKED = 2 + 2 * TOP_LOGPROBS


def _pack(sampled) -> jax.Array:
    token, chosen, ids, top = sampled
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([token[:, None], bits(chosen)[:, None], ids, bits(top)], axis=1)


def _unpack(out: np.ndarray):
    """The steps a call ran, each `(tokens, logprobs, top ids, top logprobs)` per row."""
    for step in out[out[:, 0, 0] >= 0]:
        ids = step[:, 2 : 2 + TOP_LOGPROBS]
        top = step[:, 2 + TOP_LOGPROBS :].view(np.float32)
        yield step[:, 0], step[:, 1].view(np.float32), ids, top


def _logprobs(logits, token):
    """Each row's log-probability of `token` and its `TOP_LOGPROBS` most likely tokens, from the
    model's own distribution (before any penalty, temperature or filter), as OpenAI reports them."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    return chosen, ids, top


def _no_logprobs(logits, token):
    rows = logits.shape[0]
    return (
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, TOP_LOGPROBS), jnp.int32),
        jnp.zeros((rows, TOP_LOGPROBS), jnp.float32),
    )


def _buckets(max_tokens: int) -> tuple[int, ...]:
    """The widths of a step's prompt chunk: 16, 32, 64, ... up to `max_tokens`."""
    widths, width = [], 16
    while width < max_tokens:
        widths.append(width)
        width *= 2
    return (*widths, max_tokens)
