"""Counting what XLA does: compilations, read from JAX's own monitoring events."""

from __future__ import annotations

import threading

import jax.monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA compilations in this process while it is active.

    Example:
        >>> with jaxlm.CompileCounter() as compiles:
        ...     jaxlm.generate(model, tokenizer, "Hi", max_new_tokens=4)
        >>> compiles.count, compiles.seconds
    """

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _listen(self, event: str, duration: float, **_) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1
                self.seconds += duration

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
