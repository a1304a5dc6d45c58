"""uvicorn as `jaxlm serve` runs it: limits on what a connection may send and how slowly, and a
shutdown that ends every response in its own shape.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive` and h11 refuses a
request line and headers over `h11_max_incomplete_event_size` bytes (with a 400), but nothing
bounds how long the headers take: `TimedH11Protocol` closes a connection whose request's
headers have not all arrived `HEADERS_TIMEOUT_S` after it opened or after its last response.
The application bounds the body's time itself (`jaxlm.serve.body.BODY_TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

# Seconds a connection may take to send a request's line and headers.
HEADERS_TIMEOUT_S = 10.0
# The most bytes of a request's line and headers.
MAX_HEADER_BYTES = 16 * 2**10
# Seconds an idle keep-alive connection stays open.
KEEP_ALIVE_S = 5
# Seconds after a shutdown's grace for the requests it cut to write their last bytes, before
# uvicorn cancels their tasks.
ABORT_S = 5


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose headers arrive too slowly."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._headers_timer = None
        self._arm()

    def connection_lost(self, exc) -> None:
        self._headers_timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # Armed first, with the cycle just completed: the call may start a pipelined request.
        self._arm()
        super().on_response_complete()

    def _arm(self) -> None:
        # One timer a connection, that holds nothing but the protocol: a timer for each
        # response, holding its cycle, kept megabytes alive at a few hundred requests a second.
        if self._headers_timer is not None:
            self._headers_timer.cancel()
        # A new request replaces `cycle`; the one ended (or None) still there means none came.
        self._ended = self.cycle
        self._headers_timer = self.loop.call_later(HEADERS_TIMEOUT_S, self._headers_late)

    def _headers_late(self) -> None:
        if self.cycle is self._ended and not self.transport.is_closing():
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown refuses new requests at once, lets those running finish
    for `grace` seconds, then cuts the rest through `app_server.abort()`: streams end with a
    last chunk and `data: [DONE]`, other requests with a 503."""

    def __init__(self, config: uvicorn.Config, app_server, grace: float):
        super().__init__(config)
        self.app_server, self.grace = app_server, grace

    async def shutdown(self, sockets=None) -> None:
        self.app_server.closing = True
        cut = asyncio.get_running_loop().call_later(self.grace, self.app_server.abort)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def config(app, *, host: str, port: int, grace: float, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn configuration of `jaxlm serve`, with its limits and timeouts."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=TimedH11Protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=grace + ABORT_S,
    )
