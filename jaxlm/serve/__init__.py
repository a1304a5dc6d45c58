"""`jaxlm serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Needs the `serve` extra (`pip install "jaxlm[serve]"`: Starlette, uvicorn, prometheus-client).

Example:
    >>> engine = jaxlm.LLMEngine(model, tokenizer, max_num_seqs=8, budget="2GiB")
    >>> jaxlm.serve.run(engine, model_name="smollm2", port=8000)
"""

from __future__ import annotations

import signal

from jaxlm.serve.app import create_app
from jaxlm.serve.protocol import APIError

__all__ = ["APIError", "create_app", "run"]

# How long in-flight requests may run on after SIGINT or SIGTERM before they are cut.
GRACEFUL_SHUTDOWN_S = 5.0


def run(
    engine,
    model_name: str = "jaxlm",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    grace: float = GRACEFUL_SHUTDOWN_S,
    tool_call_parser: str | None = None,
) -> None:
    """Serve `engine` until SIGINT or SIGTERM. Then the server takes no new request, lets those
    running finish for `grace` seconds and cuts the rest (a stream ends with a last chunk whose
    `finish_reason` is `"abort"` and `data: [DONE]`, another request with a 503), closes the
    engine and releases the port. `tool_call_parser` is `create_app`'s."""
    from jaxlm.serve import http

    app = create_app(engine, model_name, close_engine=True, tool_call_parser=tool_call_parser)
    config = http.config(app, host=host, port=port, grace=grace)
    # uvicorn shuts down on SIGINT or SIGTERM, then raises the signal again for the handlers it
    # found. These only note it: a `KeyboardInterrupt` raised by the handler itself could land
    # in a finalizer the main thread runs at that moment, which swallows it (the process then
    # exited 0 on SIGINT). After SIGTERM the server has stopped cleanly; SIGINT goes on as
    # `KeyboardInterrupt` (exit 130 from the command line).
    received: list[int] = []
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in handled}
    try:
        http.DrainingServer(config, app.state.server, grace).run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signal.SIGINT in received:
        raise KeyboardInterrupt
