"""The OpenAI-compatible HTTP API over an `LLMEngine`, as a Starlette application.

The engine's thread runs the steps; the event loop only parses, submits and forwards what the
handles produce. A handle's `on_update` wakes the request's task through
`loop.call_soon_threadsafe`, so no thread waits per request and nothing blocks the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import re
import secrets
import time
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxlm.batching.scheduler import QueueFullError
from jaxlm.serve import protocol, tokens, tools
from jaxlm.serve.body import BODY_TIMEOUT_S, read_json
from jaxlm.serve.guard import Guard, error_response
from jaxlm.serve.metrics import Metrics
from jaxlm.serve.protocol import APIError, quote

# The first name in backticks of an engine's `ValueError`: the argument it refused.
_NAMED = re.compile(r"`(\w+)")
# The request's fields as the engine names its arguments.
_FIELDS = {"max_new_tokens": "max_tokens", "prompts": "prompt"}


class _Choices:
    """The handles of one request's choices, and the event that wakes its task."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.wake = asyncio.Event()
        self.handles: list = []
        self.arrival = time.perf_counter()
        # Why the request ended early: its client left, or the server cut it at shutdown.
        self.gone = self.aborted = False

    def notify(self) -> None:
        # Called from the engine's thread; a loop already closed has no one left to wake.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.wake.set)

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)

    def cancel(self) -> None:
        for h in self.handles:
            if not h.done:
                h.cancel()

    async def watch(self, receive) -> None:
        """Cancel the choices as soon as the client disconnects: once the body is read, the
        next message the server receives is `http.disconnect`."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.cancel()

    async def updates(self) -> AsyncIterator[list]:
        """Each handle's new deltas as `[(index, deltas, finished)]`, until all have ended."""
        ended = [False] * len(self.handles)
        while not all(ended):
            await self.wake.wait()
            self.wake.clear()
            batch = []
            for i, h in enumerate(self.handles):
                if ended[i]:
                    continue
                finished = h.done  # read before the deltas, so none is left behind
                deltas = h.deltas()
                if deltas or finished:
                    batch.append((i, deltas, finished))
                ended[i] = finished
            if batch:
                yield batch


class _EventStream(StreamingResponse):
    """Server-sent events that cancel the request's sequences however the stream ends: a client
    gone mid-stream frees its slots and pages at once."""

    def __init__(self, events: AsyncIterator[str], choices: _Choices, running: set):
        super().__init__(events, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self.choices, self.running = choices, running

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.cancel()
            self.running.discard(self.choices)


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Server:
    """The endpoints of one engine serving one model under `model_name`."""

    def __init__(
        self,
        engine,
        model_name: str,
        body_timeout: float = BODY_TIMEOUT_S,
        tool_call_parser: str | None = None,
    ):
        if engine.tokenizer is None:
            raise ValueError("`jaxlm serve` needs a tokenizer to read and write text")
        if tool_call_parser not in (None, *tools.PARSERS):
            raise ValueError(
                f"`tool_call_parser` is one of {tools.PARSERS}, not {tool_call_parser!r}"
            )
        self.engine, self.tokenizer, self.model_name = engine, engine.tokenizer, model_name
        self.tool_parser = tool_call_parser or tools.parser_of(self.tokenizer.chat_template)
        self.body_timeout = body_timeout
        self.metrics = Metrics(engine)
        self.created = protocol.now()
        # The requests running, for a shutdown to cut; each request's choices share a group,
        # within which the engine's scheduler shares the slots fairly.
        self.running: set[_Choices] = set()
        self.closing = False
        self._groups = itertools.count()

    def abort(self) -> None:
        """End every request still running and refuse new ones: streams end with a last chunk
        (`finish_reason: "abort"`) and `data: [DONE]`, other requests with a 503."""
        self.closing = True
        for choices in list(self.running):
            choices.aborted = True
            choices.cancel()

    # Plumbing.

    async def _body(self, request: Request) -> dict:
        body = await read_json(request, self.body_timeout)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, "`model` must be a string", param="model")
        if model not in (None, self.model_name):
            raise APIError(
                404,
                f"the model {quote(model)} does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )
        if self.closing:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if not self.engine.is_running:
            raise APIError(503, "the engine has stopped")
        return body

    def _submit(self, prompts: list, parsed: protocol.Parsed, choices: _Choices, field) -> None:
        """Submit every choice of every prompt (in the thread pool: tokenizing a long prompt
        takes a while); `field` names the prompt in errors. A refused one cancels those before
        it."""
        group = next(self._groups)
        try:
            for prompt in prompts:
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                sampling = dict(parsed.sampling)
                if sampling["max_new_tokens"] is None:
                    room = self.engine.max_seq_len - len(ids) + 1
                    if room < 1:
                        raise APIError(
                            400,
                            f"the prompt has {len(ids)} tokens; this server holds at most "
                            f"{self.engine.max_seq_len} tokens a sequence",
                            param=field,
                            code="context_length_exceeded",
                        )
                    sampling["max_new_tokens"] = room
                seed = sampling.pop("seed")
                seed = secrets.randbits(32) if seed is None else seed
                for j in range(parsed.n):
                    handle = self.engine.submit(
                        ids, **sampling, seed=seed + j, on_update=choices.notify, group=group
                    )
                    choices.handles.append(handle)
        except APIError:
            choices.cancel()
            raise
        except QueueFullError as e:
            choices.cancel()
            raise APIError(429, str(e), code="queue_full") from None
        except ValueError as e:
            choices.cancel()
            message = str(e).replace("max_new_tokens", "max_tokens")
            named = _NAMED.search(str(e))
            param = _FIELDS.get(named[1], named[1]) if named else field
            raise APIError(400, message, param, code="invalid_value") from None
        except RuntimeError as e:
            choices.cancel()
            raise APIError(503, str(e)) from None

    def _chat_prompt(self, messages: list[dict], calls: tools.Tools | None) -> list[int]:
        try:
            text = tools.render(self.tokenizer, messages, calls)
        except Exception as e:  # the template's own checks (role order, ...) raise anything
            raise APIError(400, f"the chat template refused `messages`: {e}", "messages") from None
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        if not prompt:
            raise APIError(400, "`messages` render to an empty prompt", param="messages")
        return prompt

    async def _start(self, prompts: list, parsed, field: str) -> _Choices:
        if parsed.n > self.engine.max_num_seqs:
            raise APIError(
                400,
                f"`n` is at most {self.engine.max_num_seqs} on this server (its "
                f"`max_num_seqs`), got {parsed.n}",
                param="n",
                code="invalid_value",
            )
        choices = _Choices(asyncio.get_running_loop())
        await run_in_threadpool(self._submit, prompts, parsed, choices, field)
        self.running.add(choices)
        if self.closing:  # the shutdown's cut came while the choices were being submitted
            choices.aborted = True
            choices.cancel()
        return choices

    async def _wait(self, request: Request, choices: _Choices) -> list:
        """Every choice's result. A client that leaves first cancels them at once, and a
        shutdown's cut answers 503."""
        watch = asyncio.ensure_future(choices.watch(request.receive))
        try:
            while not choices.done:
                await choices.wake.wait()
                choices.wake.clear()
        finally:
            watch.cancel()
            self.running.discard(choices)
        if choices.gone:
            raise ClientDisconnect()
        if choices.aborted:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        return [h.result() for h in choices.handles]

    def _observe(self, endpoint: str, choices: _Choices, outputs: list) -> None:
        for h, out in zip(choices.handles, outputs, strict=True):
            self.metrics.observe(choices.arrival, h.token_times)
            self.metrics.requests.labels(endpoint, out.finish_reason).inc()

    def _usage(self, choices: _Choices, outputs: list) -> dict:
        # A prompt counts once however many choices it has.
        prompts = {id(h.seq.prompt): len(h.seq.prompt) for h in choices.handles}
        return protocol.usage(sum(prompts.values()), sum(len(o.token_ids) for o in outputs))

    # Endpoints.

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        parsed = protocol.parse_completion(body)
        choices = await self._start(parsed.prompts, parsed, "prompt")
        head = dict(
            id=protocol.new_id("cmpl"),
            object="text_completion",
            created=protocol.now(),
            model=self.model_name,
        )
        if parsed.stream:
            stream = self._stream_completion(head, parsed, choices)
            return _EventStream(stream, choices, self.running)
        return await self._respond(request, "completions", head, choices, self._text_choice)

    def _text_choice(self, out) -> dict:
        logprobs = None
        if out.logprobs is not None:
            logprobs = protocol.completion_logprobs(self.tokenizer, out.logprobs, 0)
        return {"text": out.text, "logprobs": logprobs}

    async def _respond(self, request, endpoint, head, choices, choice) -> Response:
        """The whole answer once every choice has ended; `choice` gives each one's body."""
        outputs = await self._wait(request, choices)
        self._observe(endpoint, choices, outputs)
        body = [
            {"index": i, "finish_reason": protocol.finish_reason(out), **choice(out)}
            for i, out in enumerate(outputs)
        ]
        return JSONResponse({**head, "choices": body, "usage": self._usage(choices, outputs)})

    async def _stream_completion(self, head, parsed, choices) -> AsyncIterator[str]:
        offsets = [0] * len(choices.handles)
        extra = {"usage": None} if parsed.include_usage else {}
        async for batch in choices.updates():
            for i, deltas, finished in batch:
                for d in deltas:
                    if not d.text and not d.token_ids:
                        continue
                    logprobs = None
                    if d.logprobs is not None:
                        logprobs = protocol.completion_logprobs(
                            self.tokenizer, d.logprobs, offsets[i]
                        )
                    offsets[i] += len(d.text)
                    choice = {"index": i, "text": d.text, "logprobs": logprobs}
                    yield _sse({**head, "choices": [choice | {"finish_reason": None}], **extra})
                if finished:
                    reason = protocol.finish_reason(choices.handles[i].result())
                    choice = {"index": i, "text": "", "logprobs": None, "finish_reason": reason}
                    yield _sse({**head, "choices": [choice], **extra})
        yield self._stream_end("completions", head, parsed, choices)

    def _stream_end(self, endpoint, head, parsed, choices) -> str:
        outputs = [h.result() for h in choices.handles]
        self._observe(endpoint, choices, outputs)
        end = ""
        if parsed.include_usage:
            end = _sse({**head, "choices": [], "usage": self._usage(choices, outputs)})
        return end + "data: [DONE]\n\n"

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        parsed, messages = protocol.parse_chat(body)
        calls = tools.parse_tools(body)
        if calls is not None and calls.forced:
            parsed.sampling["response_format"] = calls.grammar()
        prompt = await run_in_threadpool(self._chat_prompt, messages, calls)
        choices = await self._start([prompt], parsed, "messages")
        head = dict(
            id=protocol.new_id("chatcmpl"),
            object="chat.completion",
            created=protocol.now(),
            model=self.model_name,
        )
        if parsed.stream:
            head["object"] = "chat.completion.chunk"
            stream = self._stream_chat(head, parsed, choices, calls)
            return _EventStream(stream, choices, self.running)
        choice = lambda out: self._chat_choice(out, calls)
        return await self._respond(request, "chat", head, choices, choice)

    def _chat_choice(self, out, calls: tools.Tools | None) -> dict:
        logprobs = None
        if out.logprobs is not None:
            logprobs = protocol.chat_logprobs(self.tokenizer, out.logprobs)
        message = {"role": "assistant", "content": out.text}
        if calls is None:
            return {"message": message, "logprobs": logprobs}
        message, called = tools.message(out.text, calls, self.tool_parser)
        reason = {"finish_reason": "tool_calls"} if called else {}
        return {"message": message, "logprobs": logprobs, **reason}

    async def _stream_chat(self, head, parsed, choices, calls) -> AsyncIterator[str]:
        extra = {"usage": None} if parsed.include_usage else {}

        def chunk(i, delta, logprobs=None, reason=None) -> str:
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return _sse({**head, "choices": [choice], **extra})

        for i in range(len(choices.handles)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for batch in choices.updates():
            for i, deltas, finished in batch:
                # With tools, the text is held until it ends: only then is it known to be a call.
                for d in [] if calls is not None else deltas:
                    if not d.text and not d.token_ids:
                        continue
                    logprobs = None
                    if d.logprobs is not None:
                        logprobs = protocol.chat_logprobs(self.tokenizer, d.logprobs)
                    if d.text or logprobs:
                        yield chunk(i, {"content": d.text}, logprobs)
                if finished:
                    out = choices.handles[i].result()
                    reason = protocol.finish_reason(out)
                    if calls is not None:
                        message, called = tools.message(out.text, calls, self.tool_parser)
                        if message["content"]:
                            yield chunk(i, {"content": message["content"]})
                        for k, call in enumerate(message.get("tool_calls", [])):
                            yield chunk(i, {"tool_calls": [{"index": k, **call}]})
                        reason = "tool_calls" if called else reason
                    yield chunk(i, {}, reason=reason)
        yield self._stream_end("chat", head, parsed, choices)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "jaxlm",
            "max_model_len": self.engine.max_seq_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "the engine has stopped"}, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(
    engine,
    model_name: str = "jaxlm",
    *,
    close_engine: bool = False,
    body_timeout: float = BODY_TIMEOUT_S,
    tool_call_parser: str | None = None,
) -> Starlette:
    """The OpenAI-compatible application over `engine`; with `close_engine`, the application's
    shutdown closes the engine (its requests still running end as cancelled). A body that takes
    longer than `body_timeout` seconds to arrive is answered 408. `tool_call_parser` reads tool
    calls out of the model's output (`jaxlm.serve.tools.PARSERS`); by default, the chat
    template's format.

    Example:
        >>> app = create_app(jaxlm.LLMEngine(model, tokenizer, budget="2GiB"), "smollm2")
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    server = Server(engine, model_name, body_timeout, tool_call_parser)

    async def api_error(request: Request, error: APIError) -> Response:
        return error_response(error)

    async def http_error(request: Request, error: HTTPException) -> Response:
        return error_response(APIError(error.status_code, error.detail))

    async def disconnected(request: Request, error: ClientDisconnect) -> Response:
        return Response(status_code=499)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if close_engine:
            await run_in_threadpool(engine.close)

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/tokenize", functools.partial(tokens.tokenize, server), methods=["POST"]),
        Route("/detokenize", functools.partial(tokens.detokenize, server), methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(Guard)],
        exception_handlers={
            APIError: api_error,
            HTTPException: http_error,
            ClientDisconnect: disconnected,
        },
    )
    app.state.server = server
    return app
