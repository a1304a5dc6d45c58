"""Tensor- and data-parallel sharding on a JAX device mesh.

jaxlm only declares how its arrays split; JAX's partitioner (GSPMD) inserts the collectives.
Parameters and scratch name *logical* axes, and a `Partitioner` maps them onto the two mesh
axes jaxlm uses:

- `"data"` splits the batch: the rows of every scratch slot (KV cache, decode state).
- `"model"` splits the layers (Megatron style): attention heads and MLP columns in the
  column-parallel q/k/v (split by KV head, each with its query heads), gate and up projections,
  their rows in the row-parallel o and down projections (XLA adds the reduction), and the
  vocabulary of the embedding and LM head.

The logical axes are `"heads"`, `"kv_heads"`, `"mlp"`, `"vocab"`, `"experts"`, `"batch"` and
`"pages"` (the KV cache's pages).
The `model` axis must divide the attention heads and the MLP width, or `shard` refuses the
mesh. A grouped-query model with fewer KV heads than `model` devices (or a count the axis does
not divide) replicates its KV heads: each device keeps every KV head and, as they share one
projection (see `jaxlm.models.llama.Attention`), every query head, while the o projection
still splits. A vocabulary the axis does not divide is replicated too. A mixture of experts
(`"experts"`) splits its experts over `model` where the axis divides their count (expert
parallelism), and replicates them otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxlm.config import ModelConfig
from jaxlm.errors import JaxlmError

MESH_AXES = ("data", "model")


class ShardingError(JaxlmError):
    """A mesh that cannot split the model or the plan as asked."""


def make_mesh(mesh: Mesh | Sequence[int]) -> Mesh:
    """A mesh over the axes `("data", "model")`, from a `Mesh` or a shape `(data, model)` (over
    the first `data * model` devices).

    The axes are made `Auto`, so XLA propagates the shardings that jaxlm declares (a mesh made
    by `jax.make_mesh` defaults to `Explicit` axes, which type-check every operation instead).
    """
    if isinstance(mesh, Mesh):
        unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
        if unknown:
            raise ShardingError(
                f"`mesh` axes must be named among {list(MESH_AXES)}, got {list(mesh.axis_names)}"
            )
        return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)
    shape = tuple(mesh)
    if len(shape) != 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ShardingError(f"`mesh` must be a `jax.sharding.Mesh` or `(data, model)`, got {mesh}")
    devices = jax.devices()
    if math.prod(shape) > len(devices):
        raise ShardingError(
            f"a `(data, model)` mesh of {shape} needs {math.prod(shape)} devices, "
            f"there are {len(devices)}"
        )
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[: math.prod(shape)]
    )


class Partitioner:
    """Maps the logical axes of a model's arrays onto a mesh, checking that they divide."""

    def __init__(
        self,
        mesh: Mesh,
        config: ModelConfig,
        pages: str | None = None,
        draft: ModelConfig | None = None,
    ):
        """`pages` is the mesh axis the KV cache's pages split over: `"data"` where each batch
        row owns its pages (`generate`'s plans), None where any sequence may take any page (the
        serving engine's pool). With a `draft` model's config, whose pages lie in the same
        scratch, the KV heads split only where both models' divide."""
        self.mesh = mesh
        self.data = mesh.shape.get("data", 1)
        self.model = mesh.shape.get("model", 1)
        c, m = config, self.model
        for name, size in (
            ("num_attention_heads", c.num_attention_heads),
            ("intermediate_size", c.intermediate_size),
        ):
            if size % m:
                raise ShardingError(
                    f"the mesh axis `model` has {m} devices, which does not divide "
                    f"`{name}={size}`; use a `model` axis that divides it"
                )
        kv_heads = [c.num_key_value_heads, *([draft.num_key_value_heads] if draft else [])]
        rules = {
            "batch": "data",
            "heads": "model",
            "mlp": "model",
            "kv_heads": "model" if all(k % m == 0 for k in kv_heads) else None,
            "vocab": "model" if c.vocab_size % m == 0 else None,
            # Expert parallelism: each device holds whole experts.
            "experts": "model" if c.num_experts and c.num_experts % m == 0 else None,
            "pages": pages,
        }
        # A mesh may have only one of the two axes.
        self.rules = {k: v if v in mesh.axis_names else None for k, v in rules.items()}

    @property
    def kv_heads_replicated(self) -> bool:
        """Whether each device keeps every KV head (the `model` axis does not divide them)."""
        return self.model > 1 and self.rules["kv_heads"] is None

    def spec(self, axes: Sequence) -> PartitionSpec:
        """The `PartitionSpec` of an array whose dimensions carry the logical `axes`."""

        def mesh_axes(entry):
            names = entry if isinstance(entry, tuple) else (entry,)
            found = tuple(
                a for a in (self.rules.get(n) for n in names if n is not None) if a is not None
            )
            if not found:
                return None
            return found[0] if len(found) == 1 else found

        return PartitionSpec(*(mesh_axes(e) for e in axes))

    def sharding(self, axes: Sequence) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    def check_batch(self, max_batch: int) -> None:
        check_data_divides("max_batch", max_batch, self.data)


def check_data_divides(name: str, value: int, devices: int) -> None:
    """A `ShardingError` naming the argument `name` unless the mesh axis `data` of `devices`
    devices divides its `value`."""
    if value % devices:
        raise ShardingError(
            f"`{name}={value}` is not a multiple of the mesh axis `data` ({devices} devices)"
        )


def param_axes(var: nnx.Variable) -> tuple:
    """The logical axes a parameter declares (none: replicated)."""
    return var.get_metadata().get("axes") or (None,) * np.ndim(var.get_value())


def mesh_of(params) -> Mesh | None:
    """The mesh the parameters are placed on, or None on a single device."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


def shard_bytes(x) -> int:
    """Bytes of the largest piece of `x` one device holds."""
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def weights_bytes(model: nnx.Module) -> int:
    """Bytes of the parameters each device holds (all of them on a single device)."""
    return sum(shard_bytes(x) for x in jax.tree.leaves(nnx.state(model)))


def shard(model: nnx.Module, mesh: Mesh | Sequence[int]) -> nnx.Module:
    """`model` with its parameters split over `mesh` (a `Mesh` or a shape `(data, model)`).

    Returns a new model; the parameters move device to device, shard by shard. To load a model
    straight onto a mesh without a copy on one device first, use `jaxlm.load(..., mesh=...)`.
    An abstract model (`nnx.eval_shape`) gets abstract sharded parameters, enough to plan it.

    Example:
        >>> model = jaxlm.shard(model, (1, 4))        # 4-way tensor parallel
    """
    partitioner = Partitioner(make_mesh(mesh), model.config)
    graphdef, state = nnx.split(model)
    for _, var in nnx.to_flat_state(state):
        value, sharding = var.get_value(), partitioner.sharding(param_axes(var))
        if isinstance(value, jax.ShapeDtypeStruct):
            var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        else:
            var.set_value(jax.device_put(value, sharding))
    return nnx.merge(graphdef, state)
