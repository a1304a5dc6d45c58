"""Counting what XLA does: compilations, read from JAX's own monitoring events."""

from __future__ import annotations

import threading

import jax.monitoring

# JAX records this around every executable it builds, also when it loads one from the
# persistent compilation cache; a load records `_CACHE_HIT_EVENT` too.
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts XLA compilations in this process while it is active.

    `count` is the number of executables XLA compiled, `cache_hits` the number loaded from
    JAX's persistent compilation cache instead, `builds` both together (every executable made,
    which is 0 only when every call ran one already held), and `seconds` the time spent.

    Example:
        >>> with jaxlm.CompileCounter() as compiles:
        ...     jaxlm.generate(model, tokenizer, "Hi", max_new_tokens=4)
        >>> compiles.count, compiles.seconds
    """

    def __init__(self):
        self.builds = 0
        self.cache_hits = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self.builds - self.cache_hits

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self.builds += 1
                self.seconds += duration

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)
