"""Phi-3 (`jaxlm.models.phi3`): parity with transformers from safetensors and from GGUF files
written as llama.cpp's converter writes them, cached greedy decoding against transformers'
`generate`, the fused checkpoint tensors on one device and on a mesh, and the settings jaxlm
refuses. The plan of Phi-3.5-mini's real size is `tests/test_families.py`'s."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import hf_logits
from safetensors.numpy import load_file
from test_families import FULL_SIZE, TINY, assert_parity, assert_same_greedy_tokens
from test_gguf import write_gguf

import jaxlm
from jaxlm import ModelConfig
from jaxlm.loading import checkpoint_tensors

# Tiny models of 9 query and 3 KV heads.
VARIANTS = {
    # LongRoPE whose prompts and decoding (12 + 32 tokens) fit the original context, and a
    # window shorter than the prompts.
    "longrope_window": dict(
        original_max_position_embeddings=48,
        sliding_window=5,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 5000.0,
            "short_factor": [1.0, 1.2, 1.5, 2.0],
            "long_factor": [1.0, 3.0, 7.0, 16.0],
        },
    ),
    # Phi-4-mini's shape: 12 of each head's 16 features rotate, the embeddings are tied, and
    # every sequence is longer than the original context. An MLP width that 3 devices divide.
    "partial_tied_long": dict(
        hidden_size=144,
        intermediate_size=120,
        tie_word_embeddings=True,
        original_max_position_embeddings=3,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 5000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
        },
    ),
}
PHI35 = FULL_SIZE["Phi-3.5-mini-instruct"][1]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def phi3(request, tmp_path_factory):
    """A saved tiny Phi-3: `(name, directory, transformers model)`."""
    name = request.param
    config = transformers.Phi3Config(**{**TINY, **VARIANTS[name]})
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).eval()
    # Random norms catch one swapped for another; larger queries and keys make the scores, and
    # so the rotation, matter to the logits.
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif key.endswith("qkv_proj.weight"):
                p.mul_(10.0)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, path, hf


def write_phi3_gguf(path, hf):
    """`hf` as a float32 GGUF file under llama.cpp's tensor names and the metadata keys of its
    converter (`Phi3MiniModel` of `convert_hf_to_gguf.py`)."""
    config, rope = hf.config, hf.config.rope_parameters
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, config.num_hidden_layers)
    tensors = [
        (names.get_name(key, try_suffixes=(".weight",)), w.numpy().astype(np.float32), None)
        for key, w in hf.state_dict().items()
        if not (key == "lm_head.weight" and config.tie_word_embeddings)
    ]
    for kind in ("long", "short"):
        name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, f"ROPE_FACTORS_{kind.upper()}")]
        tensors.append((f"{name}.weight", np.asarray(rope[f"{kind}_factor"], np.float32), None))
    rope_dim = int(rope["partial_rotary_factor"] * config.hidden_size) // config.num_attention_heads
    original = config.original_max_position_embeddings
    scale = config.max_position_embeddings / original

    def metadata(writer):
        writer.add_context_length(config.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_dimension_count(rope_dim)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(config.sliding_window or 0)
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )

    return write_gguf(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.PHI3], tensors, metadata)


def test_safetensors_equal_transformers(phi3):
    _, path, hf = phi3
    model, _ = jaxlm.load(path)
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert_parity(model, hf)
    assert_same_greedy_tokens(model, hf, speculative=(None, "ngram"))


def test_gguf_equals_transformers(phi3, tmp_path):
    _, _, hf = phi3
    model, tokenizer = jaxlm.load(write_phi3_gguf(tmp_path / "m.gguf", hf))
    assert tokenizer is None
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert_parity(model, hf)
    assert_same_greedy_tokens(model, hf)


def test_a_sequence_beyond_the_original_context_takes_the_long_factors(phi3):
    _, path, hf = phi3
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, (1, 60))
    mask, positions = np.ones_like(ids), np.arange(60)[None]
    model, _ = jaxlm.load(path)
    np.testing.assert_allclose(
        np.asarray(model(ids)), hf_logits(hf, ids, mask, positions), atol=1e-4, rtol=0
    )


def test_checkpoint_tensors_are_the_fused_ones(phi3):
    _, path, _ = phi3
    model, _ = jaxlm.load(path)
    saved = load_file(path / "model.safetensors")
    tensors = checkpoint_tensors(model)
    assert sorted(tensors) == sorted(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


# Loads on a mesh of 3 simulated devices, which XLA fixes when it starts: each device reads
# its KV head's rows of the fused `qkv_proj` and its columns of `gate_up_proj`.
MESH_SCRIPT = """
import sys
import numpy as np
import jaxlm
ids = np.random.default_rng(0).integers(0, 96, (3, 9))
single, _ = jaxlm.load(sys.argv[1])
sharded, _ = jaxlm.load(sys.argv[1], mesh=(1, 3))
np.testing.assert_allclose(np.asarray(sharded(ids)), np.asarray(single(ids)), atol=1e-5, rtol=0)
"""


@pytest.mark.parametrize("phi3", ["partial_tied_long"], indirect=True)
def test_fused_tensors_split_over_a_mesh(phi3):
    _, path, _ = phi3
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(path)], env=env, check=True)


def test_reads_older_and_newer_configs_alike():
    old = ModelConfig.from_hf_config(PHI35)
    scaling = old.rope_scaling
    assert scaling.rope_type == "longrope"
    assert scaling.original_max_position_embeddings == 4096
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert old.sliding_window == 262144 and old.rotary_dim == 96
    # transformers 5 writes the settings into `rope_parameters`; older files call LongRoPE `su`.
    # (transformers fills in the RoPE settings it is given.)
    new = transformers.Phi3Config(**copy.deepcopy(PHI35)).to_dict()
    assert ModelConfig.from_hf_config(new) == old
    su = dict(PHI35, rope_scaling=dict(PHI35["rope_scaling"], type="su"))
    assert ModelConfig.from_hf_config(su) == old
    # Phi-4-mini rotates 96 of each head's 128 features.
    phi4 = dict(
        PHI35,
        num_attention_heads=24,
        num_key_value_heads=8,
        partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    )
    assert ModelConfig.from_hf_config(phi4).rotary_dim == 96


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(hidden_act="gelu_new"), "`hidden_act`"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "RoPE scaling type 'dynamic'"),
        (dict(rope_scaling={"type": "longrope", "long_factor": [1.0] * 48}), "`short_factor`"),
        (
            dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
            "`short_factor`",
        ),
        (dict(partial_rotary_factor=0.7), "`partial_rotary_factor`"),
        (dict(attention_bias=True), "`attention_bias`"),
        (dict(mlp_bias=True), "`mlp_bias`"),
        (dict(lm_head_bias=True), "`lm_head_bias`"),
    ],
)
def test_refuses_unimplemented_settings(change, field):
    with pytest.raises(jaxlm.LoadError, match=field):
        ModelConfig.from_hf_config(dict(PHI35, **change))
