"""The server's last line: an exception no handler took answers a 500 in OpenAI's shape."""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import JSONResponse

from jaxlm.serve.protocol import APIError

logger = logging.getLogger("jaxlm.serve")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class Guard:
    """Answers an exception no handler took with a 500 in OpenAI's shape that names nothing
    internal, and logs one line without a traceback; Starlette's own would log the traceback,
    and show the exception's name to the client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # the lifespan's failures are uvicorn's to report
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            # Only uvicorn cancels a request's task, when a shutdown's grace has run out: the
            # connection is closed.
            logger.warning("%s cancelled at shutdown", scope.get("path"))
        except Exception as e:
            logger.error("internal error on %s: %s", scope.get("path"), type(e).__name__)
            if not started:
                error = APIError(500, "the server failed to answer this request")
                await error_response(error)(scope, receive, send)
