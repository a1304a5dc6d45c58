"""Measuring the process and the machine: RSS, cores, memory bandwidth, other processes' load."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import time
from pathlib import Path

import numpy as np


def current_rss() -> int:
    """The resident set size of this process now, in bytes (`VmRSS`)."""
    from jaxlm.memory import resident_bytes

    return resident_bytes() or 0


def peak_rss() -> int:
    """The largest resident set size of this process since the last `reset_peak_rss`, in bytes
    (`VmHWM`; `ru_maxrss`, the peak since the start, where there is no `/proc`).
    """
    from jaxlm.memory import process_status

    peak = process_status("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Start a new peak RSS measurement (Linux: `5` to `/proc/self/clear_refs`); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def cores() -> int:
    """The number of cores this process may run on."""
    return len(os.sched_getaffinity(0))


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """The best memory read bandwidth of a sum over `nbytes` of float32, in bytes/s.

    Both a numpy sum (one core) and a jitted XLA reduction are timed; the best of `repeats`
    runs of either is the figure.
    """
    import jax
    import jax.numpy as jnp

    n = max(1, nbytes // 4)
    host = np.ones(n, np.float32)
    numpy_s = _best(host.sum, repeats)
    del host
    device = jnp.ones(n, jnp.float32)
    total = jax.jit(jnp.sum)
    total(device).block_until_ready()
    xla_s = _best(lambda: total(device).block_until_ready(), repeats)
    return {
        "bytes_per_s": 4 * n / min(numpy_s, xla_s),
        "numpy_bytes_per_s": 4 * n / numpy_s,
        "xla_bytes_per_s": 4 * n / xla_s,
        "probe_bytes": 4 * n,
        "repeats": repeats,
    }


class OtherLoad:
    """Cores kept busy by other processes while the block runs, from `/proc/stat`.

    On a shared machine this tells a clean measurement from one that competed for the cores.

    Example:
        >>> with OtherLoad() as load:
        ...     work()
        >>> load.cores
    """

    def __init__(self):
        self.cores = 0.0

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        # idle and iowait are the 4th and 5th fields.
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def __enter__(self) -> OtherLoad:
        self._start = (self._busy(), self._own(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = self._start
        elapsed = time.perf_counter() - wall
        others = (self._busy() - busy) - (self._own() - own)
        self.cores = max(0.0, others / elapsed) if elapsed > 0 else 0.0


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def l3_bytes() -> int | None:
    path = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    try:
        text = path.read_text().strip().upper()
    except OSError:
        return None
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


@contextlib.contextmanager
def persistent_cache(path: str):
    """Use `path` as JAX's persistent compilation cache for every executable, then restore."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {name: getattr(jax.config, name) for name in names}
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:
        yield
    finally:
        compilation_cache.reset_cache()
        for name, value in old.items():
            jax.config.update(name, value)
