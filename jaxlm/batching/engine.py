"""`LLMEngine`: continuous batching of a model's requests over a paged KV cache.

A thread of the engine's own runs steps while requests come and go: `Scheduler.schedule()`
picks each step's decode tokens and prompt chunks, one jitted call (`jaxlm.batching.step`) runs
them over the pages, samples the next token of every sequence that has reached its end, and
returns the pages updated in place. Requests join at the next step and leave when they stop,
so none waits for another to finish. Every step is compiled when the engine starts, so serving
never compiles.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from jaxlm.batching import lockstep
from jaxlm.batching.handle import RequestHandle
from jaxlm.batching.pages import PagePool
from jaxlm.batching.plan import EnginePlan, plan_engine
from jaxlm.batching.sampled import unpack
from jaxlm.batching.scheduler import Batch
from jaxlm.batching.shards import ShardedScheduler
from jaxlm.constrain import Grammars, grammar_of, grammars_for
from jaxlm.outputs import RequestOutput
from jaxlm.requests import SamplingParams, parse_request, sampling_params
from jaxlm.speculative import request_drafts

# `submit`'s `speculative` when not given: the engine's.
ENGINE_DEFAULT = "engine"


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
    # Token bitmasks filled for rows with a grammar, and the host's seconds filling them.
    grammar_masks: int = 0
    grammar_mask_seconds: float = 0.0
    # Tokens drafted (`speculative`), and those of them the model kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class LLMEngine:
    """Serve a model's requests by continuous batching over a paged KV cache.

    The engine runs a `plan` (`jaxlm.plan(model, max_num_seqs=...)`): its pages, allocated once
    here, and its steps, compiled when it was made. Without one, the sizes make it:
    `max_num_seqs` sequences (4) run at once, each up to `max_seq_len` tokens in pages of
    `page_size`; `num_pages` pages in all (page 0 pads), as many as `budget` leaves beside the
    weights and the steps' temporaries, or with `max_seq_len` alone, enough for every sequence
    at its longest. A step runs at most `max_num_batched_tokens` tokens.
    Decode steps run `decode_steps` at a time while no prompt waits, ending early where a
    request samples a stop token: the tokens of a call reach its requests together. On a model
    sharded over a mesh (`jaxlm.load(..., mesh=...)`), the pages split by KV head over `model`,
    and the slots and pages evenly over `data`, a pool of pages for each shard (`pools`).
    On a mesh that spans several processes, every process makes the engine and runs the same
    steps (`jaxlm.batching.lockstep`): process 0 takes the requests, and each of the others
    runs `follow()` until process 0 closes the engine.
    With `speculative="ngram"`, requests draft tokens from their own text while they decode
    (`jaxlm.speculative`), `num_speculative_tokens` (3) at a time, as `generate` does; with
    `speculative=draft`, a smaller model of the same vocabulary, they take its greedy tokens as
    drafts (its pages beside the model's, in the same plan); either way their tokens are those
    they give without.

    Example:
        >>> plan = jaxlm.plan(model, max_num_seqs=4, budget="1GiB")
        >>> print(plan)                  # the pages, the steps' temporaries, the whole bill
        >>> engine = jaxlm.LLMEngine(model, tokenizer, plan)
        >>> handles = [engine.submit(p, max_new_tokens=32) for p in prompts]
        >>> [h.result().text for h in handles]
        >>> engine.close()
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        plan: EnginePlan | None = None,
        *,
        max_num_seqs: int | None = None,
        max_seq_len: int | None = None,
        page_size: int | None = None,
        num_pages: int | None = None,
        budget: int | str | None = None,
        max_num_batched_tokens: int | None = None,
        decode_steps: int | None = None,
        speculative: str | nnx.Module | None = None,
        num_speculative_tokens: int | None = None,
        prefix_cache: bool = True,
        max_queue: int = 1024,
    ):
        sizes = dict(
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
        if plan is None:
            sizes["max_num_seqs"] = 4 if max_num_seqs is None else max_num_seqs
            plan = plan_engine(model, **sizes)
        elif any(v is not None for v in sizes.values()):
            given = ", ".join(f"`{k}`" for k, v in sizes.items() if v is not None)
            raise ValueError(f"give a `plan` or its sizes ({given}), not both")
        elif plan.model is not model:
            raise ValueError("`plan` was made for another model; plan this one")
        self.model, self.tokenizer, self.plan = model, tokenizer, plan
        self._state = nnx.state(plan.models)
        self._steps = plan.steps
        self.compiled = plan.compiled
        self.page_size = plan.page_size
        self.pages_per_seq = plan.pages_per_seq
        self.max_num_seqs = plan.max_num_seqs
        self.decode_steps = plan.decode_steps
        self.speculative = plan.speculative
        self.num_speculative_tokens = plan.num_speculative_tokens
        shards = self._steps.shards
        # A pool of pages for each shard of the mesh's `data` axis, numbered from its own 0.
        self.pools = tuple(
            PagePool(plan.num_pages // shards, plan.page_size, prefix_cache=prefix_cache)
            for _ in range(shards)
        )
        self.scheduler = ShardedScheduler.over(
            self.pools,
            max_num_seqs=plan.max_num_seqs,
            max_num_batched_tokens=plan.max_num_batched_tokens,
            pages_per_seq=plan.pages_per_seq,
            max_queue=max_queue,
            chunk_shapes=self._steps.chunk_shapes,
        )
        # The one allocation of the engine's pages, from its plan.
        self.pages = plan.allocate()
        self.steps = 0
        self.calls = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.finished = 0
        self.drafted_tokens = self.accepted_tokens = 0
        self._handles: dict[int, RequestHandle] = {}
        # The tokenizer's grammars (`constrain.grammars_for`), on the first constrained request.
        self._grammars: Grammars | None = None
        self._mask: np.ndarray | None = None
        self.grammar_masks, self.grammar_mask_seconds = 0, 0.0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        # Across processes: what process 0 hands the others at the next call, and on the
        # others, the requests that `follow()` has yet to hand out.
        self._lockstep = lockstep.spans_processes(plan.mesh)
        self._follower = self._lockstep and jax.process_index() != 0
        self._events: list = []
        self._followed: list[RequestHandle] = []
        # A process other than 0 runs the steps in `follow()`, in the caller's thread.
        self._thread = None
        if not self._follower:
            self._thread = threading.Thread(target=self._loop, name="jaxlm-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            while self._call():
                pass
        except BaseException as error:  # the engine cannot go on: fail every request
            self._fail_all(error)

    def follow(self) -> Iterator[RequestOutput]:
        """On a process other than 0: run the engine's steps with process 0's until it closes
        the engine, yielding the result of each request as it finishes here (the same as
        process 0's). Process 0 waits for every process at each step, so keep iterating."""
        if not self._follower:
            raise RuntimeError("`follow` runs on the processes other than 0, which serves")
        return self._follow()

    def _follow(self) -> Iterator[RequestOutput]:
        while self._call():
            with self._wake:
                done, self._followed = self._followed, []
            yield from (h.result() for h in done)

    def _call(self) -> bool:
        """Schedule, run and record one XLA call; False once the engine is closed."""
        with self._wake:
            if self._lockstep:
                if not self._exchange():
                    return False
            else:
                while not self._closed and not self.scheduler.has_work():
                    self._wake.wait()
                if self._closed:
                    return False
            # Slots for drafts, where a request drafts.
            drafts = any(h._drafts for h in self._handles.values())
            spare = self.num_speculative_tokens if drafts else 0
            batch = self.scheduler.schedule(self.decode_steps, spare)
            if not batch.chunks:
                return True
            requests = {c.seq.id: self._handles[c.seq.id]._req for c in batch.chunks}
            logprobs = {i for i in requests if self._handles[i].logprobs is not None}
            if batch.steps > 1 and any(self._handles[i]._matcher is not None for i in requests):
                # Its pages for the steps not run serve the next calls.
                batch = dataclasses.replace(batch, steps=1)
            mask = self._fill_masks(batch)
            drafting = {i for i in requests if self._handles[i]._drafts}
            shape, inputs = self._steps.inputs(batch, requests, logprobs, mask, drafting)
            rows = {c.seq.id: self._steps.row(c.seq, shape) for c in batch.chunks if c.sample}
        self.pages, out = self.compiled[shape](self._state, self.pages, inputs)
        out = np.asarray(out)
        self.calls += 1
        with self._wake:
            if shape.drafts:
                # By the slots of the call: a request cancelled while it ran has none now.
                for c in batch.chunks:
                    drafted, accepted, wait, backoff, draft_len = out[-1, rows[c.seq.id], 1:6]
                    self.drafted_tokens += int(drafted)
                    self.accepted_tokens += int(accepted)
                    if (handle := self._handles.get(c.seq.id)) is not None:
                        handle.drafted_tokens += int(drafted)
                        handle.accepted_tokens += int(accepted)
                    c.seq.draft_wait, c.seq.draft_backoff = int(wait), int(backoff)
                    c.seq.draft_len = int(draft_len)
            for tokens, *logprobs in unpack(out):
                sampled = {i: int(tokens[r]) for i, r in rows.items() if tokens[r] >= 0}
                if len(sampled) < len(rows):
                    # Rows that drafted ran ahead: the others have no token in this step.
                    chunks = tuple(c for c in batch.chunks if c.seq.id in sampled)
                    batch = dataclasses.replace(batch, chunks=chunks)
                self._record(batch, sampled, logprobs, rows)
                batch = self.scheduler.next_steps(batch)
                rows = {c.seq.id: self._steps.row(c.seq, shape) for c in batch.chunks}
        return True

    def _exchange(self) -> bool:
        """Hand process 0's events since the last call to every process, which replays them
        (`jaxlm.batching.lockstep`); False once process 0 has closed the engine."""
        if not self._follower:
            if not (self._closed or self._events or self.scheduler.has_work()):
                self._wake.wait(lockstep.HEARTBEAT)
            events, self._events = self._events, []
            if self._closed:
                events.append(lockstep.Close())
        else:
            events = []
        for event in lockstep.exchange(events):
            if isinstance(event, lockstep.Close):
                self._closed = True
                return False
            if isinstance(event, lockstep.Cancel):
                if (handle := self._handles.get(event.seq_id)) is not None:
                    self._cancel_now(handle)
            elif self._follower:
                req = parse_request(self.model, self.tokenizer, [event.prompt], event.params)
                self._admit(req, self._grammar(req), event.group, event.drafts, None)
        return True

    def _fill_masks(self, batch: Batch) -> np.ndarray | None:
        """The token bitmask of every row, where a row that samples in `batch` has a grammar."""
        rows = [
            (m, self._steps.row(c.seq))
            for c in batch.chunks
            if c.sample and (m := self._handles[c.seq.id]._matcher) is not None
        ]
        if not rows:
            return None
        if self._mask is None:
            self._mask = np.empty((self.max_num_seqs, self._steps.mask_words), np.int32)
        self._mask.fill(-1)
        start = time.perf_counter()
        self._grammars.fill(rows, self._mask)
        self.grammar_mask_seconds += time.perf_counter() - start
        self.grammar_masks += len(rows)
        return self._mask

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
        for i, t in sampled.items():
            # A grammar complete ends its request, as a stop token does.
            if (m := self._handles[i]._matcher) is not None and m.advance(t):
                stop[i] = True
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
                if self._follower:
                    self._followed.append(handle)

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            for handle in self._handles.values():
                handle._fail(error)
            self._handles.clear()
            self._closed = True

    @property
    def max_seq_len(self) -> int:
        """The most tokens a sequence holds, prompt and generated: its pages, or all of them."""
        return min(self.scheduler.max_tokens_per_seq, self.pools[0].num_usable * self.page_size)

    @property
    def is_running(self) -> bool:
        """Whether the engine runs: not closed, and its thread (on a process other than 0,
        `follow()`'s caller's) has not died."""
        return not self._closed and (self._thread is None or self._thread.is_alive())

    def stats(self) -> EngineStats:
        """The engine's counters now (see `EngineStats`)."""
        with self._wake:
            s, pools = self.scheduler, self.pools
            return EngineStats(
                running=len(s.running),
                waiting=len(s.waiting),
                pages_total=sum(p.num_usable for p in pools),
                pages_in_use=sum(p.num_in_use for p in pools),
                pages_free=sum(p.num_available for p in pools),
                pages_cached=sum(p.num_cached for p in pools),
                steps=self.steps,
                calls=self.calls,
                prefill_tokens=self.prefill_tokens,
                cached_prompt_tokens=s.cached_tokens,
                generated_tokens=self.generated_tokens,
                preemptions=s.preemptions,
                finished=self.finished,
                grammar_masks=self.grammar_masks,
                grammar_mask_seconds=self.grammar_mask_seconds,
                drafted_tokens=self.drafted_tokens,
                accepted_tokens=self.accepted_tokens,
            )

    def clear_cache(self) -> None:
        """Forget the prefix cache's pages that no sequence holds: they become free."""
        with self._wake:
            for pool in self.pools:
                pool.clear_cache()

    # Requests.

    def submit(
        self,
        prompt,
        params: SamplingParams | None = None,
        *,
        on_update: Callable[[], None] | None = None,
        group: Hashable = None,
        speculative=ENGINE_DEFAULT,
        **sampling,
    ) -> RequestHandle:
        """Queue one request (a string or token ids); returns its handle at once.

        `params` is a `jaxlm.SamplingParams` (its fields as keywords make one, or replace its
        own), as `jaxlm.generate` takes it, for one prompt; a bad one raises `ValueError` here,
        and a full queue `QueueFullError`. `on_update` is called from the engine's thread
        whenever the handle has new deltas or has ended; it must not block. Requests submitted
        with one `group` (the choices of one HTTP request) share the batch's slots with other
        groups as one (see `Scheduler`). A request with a grammar (`response_format`) runs one
        decode step a call.

        `speculative` (`"engine"`: the engine's way) drafts tokens the engine's way (`"ngram"`,
        or its draft model), or not (None); a request with a grammar does not draft.

        Example:
            >>> h = engine.submit("JSON: ", max_new_tokens=64, response_format=MyModel)
            >>> MyModel.model_validate_json(h.result().text)"""
        if self._follower:
            raise RuntimeError("process 0 takes the requests; this process runs `follow()`")
        if isinstance(speculative, str) and speculative == ENGINE_DEFAULT:
            speculative = self.speculative
        drafts = request_drafts(speculative, self.speculative)
        req = parse_request(self.model, self.tokenizer, prompt, sampling_params(params, sampling))
        if len(req.prompts) != 1:
            raise ValueError("`submit` takes one prompt; submit each of several on its own")
        # Compiling a grammar takes a while for a large schema: not under the engine's lock.
        grammar = self._grammar(req)
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            handle = self._admit(req, grammar, group, drafts, on_update)
            if self._lockstep:
                # The other processes replay it: token ids, and a grammar rather than a class
                # that only this process may define.
                params = dataclasses.replace(req.params, response_format=grammar[0])
                self._events.append(lockstep.Submit(req.prompts[0], params, group, drafts))
            self._wake.notify()
        return handle

    def _grammar(self, req) -> tuple:
        """A request's grammar and its matcher (both None without)."""
        grammar = grammar_of(req.params.response_format)
        if grammar is None:
            return None, None
        self._grammars = grammars_for(self.tokenizer, self.model.config.vocab_size)
        return grammar, self._grammars.matcher(grammar)

    def _admit(self, req, grammar, group: Hashable, drafts: bool, on_update) -> RequestHandle:
        """Queue a parsed request with its `_grammar` (under the engine's lock); its handle."""
        req.stop_ids = frozenset(int(t) for t in req.stop_ids if t >= 0)
        seq = self.scheduler.submit(req.prompts[0], req.max_new_tokens, group)
        handle = RequestHandle(self, seq, req, self.tokenizer, on_update)
        handle._matcher = grammar[1]
        # Drafts would need the host's mask at every position: such rows do not.
        handle._drafts = drafts and handle._matcher is None
        self._handles[seq.id] = handle
        return handle

    def generate(
        self, prompts: Sequence, params: SamplingParams | None = None, **kwargs
    ) -> list[RequestOutput]:
        """Submit every prompt and wait for all: `[handle.result() ...]` in their order."""
        handles = [self.submit(p, params, **kwargs) for p in prompts]
        return [h.result() for h in handles]

    def _cancel(self, handle: RequestHandle) -> None:
        with self._wake:
            if handle._done.is_set():
                return
            if self._lockstep:
                # At the next call, on every process.
                self._events.append(lockstep.Cancel(handle.seq.id))
                self._wake.notify()
            else:
                self._cancel_now(handle)

    def _cancel_now(self, handle: RequestHandle) -> None:
        self.scheduler.cancel(handle.seq)
        handle._step(True)
        self._handles.pop(handle.seq.id, None)
        if self._follower:
            self._followed.append(handle)

    def close(self) -> None:
        """Stop the engine's thread; requests still running end as cancelled. Across
        processes, process 0's ends every process's `follow()`."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        for handle in list(self._handles.values()):
            self.scheduler.cancel(handle.seq)
            handle._step(True)
        self._handles.clear()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
