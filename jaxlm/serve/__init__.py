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
    # uvicorn shuts down on SIGTERM, then raises it again for the handler it found: exit 0 then,
    # as the server has stopped cleanly (SIGINT raises `KeyboardInterrupt` as usual).
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        http.DrainingServer(config, app.state.server, grace).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit(signum, frame) -> None:
    raise SystemExit(0)
