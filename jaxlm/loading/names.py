"""How a model's parameters map to checkpoint tensors: names, and the parameters that join
several tensors (stacked, grouped, fused, per expert), both ways."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.config import ModelConfig

# Parameters that join several checkpoint tensors: a part of the parameter's name -> the same
# part of each tensor's name, in order. Gate and up stack along a leading axis (see
# `jaxlm.layers.MLP`); the query, key and value projections are `[kv_heads, rows, ...]`, each
# KV head's block the rows of its query heads, its key and its value (see
# `jaxlm.models.llama.Attention`).
STACKED = {".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj.")}
GROUPED = {
    ".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.")
}
# The families whose checkpoints hold these joined parameters as one tensor each, named as the
# parameter, its parts (those of `STACKED` or `GROUPED`) concatenated along the rows.
FUSED = {"phi3": (".self_attn.qkv_proj.", ".mlp.gate_up_proj.")}
# A mixture of experts stacks each layer's experts in one parameter (see `jaxlm.models.moe`),
# as checkpoints that transformers 5 writes with `save_original_format=False` hold them. The
# Hub's hold one tensor per expert: by `model_type`, a part of the parameter's name -> the same
# part of each expert's tensors (`{e}` its index), in order, joined as `"experts"`; a part
# without `{e}` renames a tensor (Mixtral's router).
PER_EXPERT = {
    "mixtral": {
        ".mlp.gate.": (".block_sparse_moe.gate.",),
        ".mlp.experts.gate_up_proj": (
            ".block_sparse_moe.experts.{e}.w1.weight",
            ".block_sparse_moe.experts.{e}.w3.weight",
        ),
        ".mlp.experts.down_proj": (".block_sparse_moe.experts.{e}.w2.weight",),
    },
    "qwen3_moe": {
        ".mlp.experts.gate_up_proj": (
            ".mlp.experts.{e}.gate_proj.weight",
            ".mlp.experts.{e}.up_proj.weight",
        ),
        ".mlp.experts.down_proj": (".mlp.experts.{e}.down_proj.weight",),
    },
}


def param_name(path) -> str:
    return ".".join(str(k) for k in path)


def join_kind(name: str) -> str | None:
    """How parameter `name` joins checkpoint tensors: `"stacked"`, `"grouped"` or None."""
    for kind, table in (("stacked", STACKED), ("grouped", GROUPED)):
        if any(joined in name for joined in table):
            return kind
    return None


def checkpoint_names(name: str, model_type: str | None = None) -> tuple[str, ...]:
    """The checkpoint tensors that model parameter `name` holds, in order if it joins several
    (see `STACKED` and `GROUPED`), else `(name,)`; `(name,)` too where the checkpoints of
    `model_type` fuse its parts (see `FUSED`).
    """
    if any(fused in name for fused in FUSED.get(model_type, ())):
        return (name,)
    for joined, parts in (STACKED | GROUPED).items():
        if joined in name:
            return tuple(name.replace(joined, part) for part in parts)
    return (name,)


def stored_as(
    name: str, config: ModelConfig, available=frozenset()
) -> tuple[tuple[str, ...], str | None]:
    """The checkpoint tensors that hold parameter `name` and how they join (see `join_kind`):
    a mixture of experts' parameter is itself where the checkpoint, of tensors `available`,
    holds it, else the Hub's tensors (see `PER_EXPERT`).
    """
    for joined, parts in PER_EXPERT.get(config.model_type, {}).items():
        if joined in name and name not in available:
            if "{e}" not in parts[0]:
                return (name.replace(joined, parts[0]),), None
            experts = range(config.num_experts)
            names = (name.replace(joined, p).format(e=e) for e in experts for p in parts)
            return tuple(names), "experts"
    return checkpoint_names(name, config.model_type), join_kind(name)


def part_shapes(
    config: ModelConfig, kind: str | None, shape, count: int = 1
) -> list[tuple[int, ...]]:
    """The shapes of the `count` checkpoint tensors that a parameter of `shape` joins as
    `kind`."""
    if kind == "experts":
        per_expert = count // shape[0]
        return [(shape[1] // per_expert, *shape[2:])] * count
    if kind == "stacked":
        return [tuple(shape[1:])] * shape[0]
    if kind == "grouped":
        d, rest = config.head_dim, tuple(shape[2:])
        q = config.num_attention_heads * d
        kv = config.num_key_value_heads * d
        return [(q, *rest), (kv, *rest), (kv, *rest)]
    return [tuple(shape)]


def stored_shapes(shapes, fused: bool) -> list[tuple[int, ...]]:
    """The shapes of the checkpoint tensors that hold the parts of `shapes`: the parts', or
    where `fused`, that of the one tensor of them all along its rows (see `FUSED`)."""
    if not fused:
        return shapes
    return [(sum(shape[0] for shape in shapes), *shapes[0][1:])]


def fused_rows(shapes) -> list[tuple[int, int]]:
    """The rows `(start, stop)` of each part of `shapes` in the tensor that fuses them."""
    stops = np.cumsum([shape[0] for shape in shapes]).tolist()
    return list(zip([0, *stops[:-1]], stops, strict=True))


def rows_reader(read, rows: tuple[int, int]):
    """The reader of the part at `rows` of the tensor that `read` reads."""
    start, stop = rows

    def part(index):
        first, last, _ = index[0].indices(stop - start)
        return read((slice(start + first, start + last), *index[1:]))

    return part


def join(kind: str, values, shape, shapes) -> jax.Array:
    """The parameter of `shape` from its checkpoint tensors' `values`: the tensors `"stacked"`
    along a leading axis, or `"grouped"`, each reshaped to `[shape[0], rows, ...]` and joined
    along its rows, or `"experts"`, each expert's tensors joined along their rows and the
    experts stacked. A parameter of one tensor (`kind` None) is that tensor, unjoined; one
    tensor that fuses the parts of `shapes` (see `FUSED`) is cut into them first.
    """
    if len(values) < len(shapes):
        values = [values[0][start:stop] for start, stop in fused_rows(shapes)]
    if kind == "stacked":
        return jnp.stack(values)
    if kind == "experts":
        return jnp.stack(values).reshape(shape)
    return jnp.concatenate([v.reshape(shape[0], -1, *v.shape[1:]) for v in values], axis=1)


def split(kind: str | None, value, shapes) -> list:
    """The checkpoint tensors of `shapes` that a parameter joined as `kind` holds in `value`:
    the inverse of `join`.
    """
    if kind is None:
        return [value]
    if kind == "stacked":
        return [value[i] for i in range(len(shapes))]
    if kind == "experts":
        return list(value.reshape(len(shapes), *shapes[0]))
    out, start = [], 0
    for shape in shapes:
        rows = shape[0] // value.shape[0]
        out.append(value[:, start : start + rows].reshape(shape))
        start += rows
    return out


def checkpoint_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The parameters of `model` by checkpoint tensor name, as stored (joined ones split), as
    NumPy arrays.
    """
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, value = param_name(path), np.asarray(var.get_value())
        names, kind = stored_as(name, model.config)
        parts = split(kind, value, part_shapes(model.config, kind, value.shape, len(names)))
        if len(names) < len(parts):
            parts = [np.concatenate(parts)]
        out.update(zip(names, parts, strict=True))
    return out
