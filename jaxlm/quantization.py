"""`jaxlm.quantize`: a model's weights in 8 or 4 bits.

`int8`:

Every projection (q/k/v, o, gate/up, down), the LM head and the embedding table keep their
weights as int8 with one float32 scale per output row (per token for the table), their input
rotated first (`jaxlm.ops.quantize_weight`). Norms, biases, the KV cache and the activations
between products stay in the model's float dtype. The products round their activations to
int8 as they run (`jaxlm.ops.quantized_matmul`); embedding rows are dequantized and rotated
back as they are gathered (`jaxlm.ops.quantized_rows`).

`int4`: the projections whose input is a multiple of 32 in 4-bit blocks of 32 with a float16
scale and minimum each (`jaxlm.kernels.int4`, GGUF's Q4_1); the embedding table (the tied LM
head), and any projection of another width, in int8 as above. llama.cpp's 4-bit files keep
their embeddings in 8 bits too: the LM head's rounding weighs on every token's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import generator, ops
from jaxlm.kernels import int4
from jaxlm.layers import Embedding, Linear

QUANTIZE_MODES = ("int8", "int4")
# The float dtypes an int8 model keeps its norms, caches and activations in.
QUANTIZED_DTYPES = (jnp.float32, jnp.bfloat16)


def check_quantize(quantize: str | None, dtype=None) -> str | None:
    """`quantize` if jaxlm offers it with `dtype` (the model's float dtype), else `ValueError`."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"`quantize` must be None, `int8` or `int4`, got {quantize!r}")
    if dtype is not None and jnp.dtype(dtype) not in QUANTIZED_DTYPES:
        raise ValueError(
            f"`quantize={quantize!r}` keeps the norms and the KV cache in float32 or bfloat16; "
            f"`dtype` {jnp.dtype(dtype).name} is not accepted with it"
        )
    return quantize


def quantized_params(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """The layers of `model` that `quantize` stores in 8 or 4 bits, with their paths."""
    return [
        (".".join(map(str, path)), module)
        for path, module in nnx.iter_modules(model)
        if isinstance(module, Linear | Embedding)
    ]


def in_4_bits(module: nnx.Module, mode: str) -> bool:
    """Whether `quantize(model, mode)` stores `module`'s weight in 4 bits."""
    if mode != "int4" or not isinstance(module, Linear):
        return False
    return module.weight.get_value().shape[-1] % int4.BLOCK == 0


def quantize(model: nnx.Module, mode: str = "int8") -> nnx.Module:
    """Store `model`'s projections, LM head and embedding table in `mode` (`"int8"` or
    `"int4"`, see above), in place; returns it.

    Also runs inside `nnx.eval_shape` on an abstract model, which is how `jaxlm.load(...,
    quantize=...)` and `jaxlm.plan` see the quantized shapes before any weight exists.

    Example:
        >>> model, tokenizer = jaxlm.load()
        >>> model = jaxlm.quantize(model, "int4")
    """
    check_quantize(mode, getattr(model, "dtype", None))
    layers = quantized_params(model)
    covered = {path for path, _ in layers}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path))
        if var.get_value().ndim >= 2 and name.rpartition(".")[0] not in covered:
            raise ValueError(
                f"`quantize` stores linear layers and embeddings in int8; `{name}` is neither "
                "(a mixture of experts' stacked experts are not quantized yet)"
            )
    quantize_weight, quantize_int4 = jax.jit(ops.quantize_weight), jax.jit(int4.quantize)
    for _, module in layers:
        if module.scale is not None:
            continue
        var = module.weight
        axes = var.get_metadata().get("axes") or (None,) * var.get_value().ndim
        floats = embedding_floats(module) if isinstance(module, Embedding) else var.get_value()
        if in_4_bits(module, mode):
            q, scale = quantize_int4(floats)
            scale_axes = (*axes[:-1], None, None)
        else:
            q, scale = quantize_weight(floats)
            scale_axes = axes[:-1]
        module.weight = nnx.Param(q, axes=axes)
        module.scale = nnx.Param(scale, axes=scale_axes)
    # `generate` runs the quantized weights from now on, and the float ones can go.
    generator.forget(model)
    return model


def embedding_floats(module: Embedding) -> jax.Array:
    """An embedding's float table, from the bits `jaxlm.ops.embedding_storage` may keep."""
    table = module.weight.get_value()
    if table.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(table, module.dtype)
    return table
