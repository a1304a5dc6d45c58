"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt (or chat messages, rendered by the
chat template) to token ids, and ids back to text, in vLLM's request and response shapes."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxlm.requests import is_int
from jaxlm.serve import protocol, tools
from jaxlm.serve.protocol import APIError


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"`{name}` must be a boolean", param=name, code="invalid_value")
    return value


async def tokenize(server, request: Request) -> Response:
    """`{"prompt": str, "add_special_tokens": true}` or `{"messages": [...],
    "add_generation_prompt": true}` (with `tools`) to `{"count", "max_model_len", "tokens",
    "token_strs"}`."""
    body = await server._body(request)
    tok = server.tokenizer
    strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        if not _flag(body, "add_generation_prompt", True):
            raise APIError(
                400,
                "`add_generation_prompt: false` is not supported",
                param="add_generation_prompt",
                code="invalid_value",
            )
        _, messages = protocol.parse_chat(body)
        calls = tools.parse_tools(body)
        ids = await run_in_threadpool(server._chat_prompt, messages, calls)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "`prompt` must be a string", param="prompt", code="invalid_value")
        special = _flag(body, "add_special_tokens", True)
        ids = await run_in_threadpool(tok.encode, prompt, special)
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": server.engine.max_seq_len,
            "tokens": ids,
            "token_strs": [tok.backend.id_to_token(i) for i in ids] if strs else None,
        }
    )


async def detokenize(server, request: Request) -> Response:
    """`{"tokens": [int, ...]}` to `{"prompt": str}`."""
    body = await server._body(request)
    ids, vocab = body.get("tokens"), server.engine.model.config.vocab_size
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
        raise APIError(
            400,
            f"`tokens` must be a list of token ids in [0, {vocab})",
            param="tokens",
            code="invalid_value",
        )
    text = await run_in_threadpool(server.tokenizer.decode, ids)
    return JSONResponse({"prompt": text})
