"""A request body read and checked before any field is: its size, how long it takes to arrive,
its JSON nesting and its Unicode.

Each check raises `APIError`, so that no body, however hostile, reaches `json.loads` or the
tokenizer in a form that makes them raise something else.
"""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np

from jaxlm.serve.protocol import APIError

# The largest request body; a prompt of a full context of text is far smaller.
MAX_BODY_BYTES = 8 * 2**20
# Seconds a body may take to arrive whole: a client sending a byte a second holds a connection
# and a task for no one.
BODY_TIMEOUT_S = 10.0
# The deepest nesting of arrays and objects: OpenAI's bodies need 4 (a chat message's content
# parts), and `json.loads` recurses once per level.
MAX_DEPTH = 32

# A JSON string, escapes included, to be blanked before brackets are counted.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request, timeout: float = BODY_TIMEOUT_S) -> dict:
    """The request's body as a JSON object, checked; a `413`, `408` or `400` `APIError` if it is
    too large, too slow, not JSON, nested too deep or holds text that is not Unicode."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        async with asyncio.timeout(timeout):
            data = await _read(request)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s") from None
    depth = nesting(data)
    if depth > MAX_DEPTH:
        raise APIError(
            400, f"the body nests arrays and objects deeper than {MAX_DEPTH}", code="invalid_json"
        )
    # Bytes that are not UTF-8 become lone surrogates, so that `unicode_error` names the field
    # that holds them, as it does for a surrogate escaped as `\ud800`.
    text = data.decode("utf-8", "surrogateescape")
    try:
        body = json.loads(text)
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    where = unicode_error(body)
    if where is not None:
        raise APIError(
            400,
            f"`{where}` holds text that is not valid Unicode (a lone surrogate or bytes that are "
            "not UTF-8)",
            param=where,
            code="invalid_value",
        )
    return body


async def _read(request) -> bytes:
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    return bytes(data)


def nesting(data: bytes) -> int:
    """How deep `data`'s arrays and objects nest, brackets inside strings aside; counted over the
    bytes, so that no depth makes anything recurse."""
    flat = np.frombuffer(_STRING.sub(b'""', data), np.uint8)
    steps = np.isin(flat, (ord("["), ord("{"))).astype(np.int32)
    steps -= np.isin(flat, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def unicode_error(body: dict) -> str | None:
    """The path (`messages[0].content`) of a string of `body`, key or value, that holds a lone
    surrogate; None if none does."""
    todo = [(body, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, dict):
            for key in value:
                if not key.isascii() and _SURROGATE.search(key):
                    return _join(path, key)
            items = value.items()
        else:
            items = enumerate(value)
        # Paths are built for containers and bad strings only: a prompt of token ids is long.
        for key, item in items:
            if isinstance(item, str):
                if not item.isascii() and _SURROGATE.search(item):
                    return _join(path, key)
            elif isinstance(item, dict | list):
                todo.append((item, _join(path, key)))
    return None


def _join(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key
