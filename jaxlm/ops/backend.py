"""Which backend runs the computation, the one question `jaxlm.ops` asks before lowering."""

from __future__ import annotations

import jax


def platform() -> str:
    """The platform jaxlm computes on (`"cpu"`, `"gpu"`, ...): its default device's."""
    return jax.devices()[0].platform
