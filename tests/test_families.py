"""The families beyond Llama: parity with transformers from safetensors and from GGUF files
written as llama.cpp's converter writes them, cached greedy decoding against transformers'
`generate`, and the plan of each family's real size built abstractly."""

from __future__ import annotations

import gc

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import BASE, forward, hf_logits, padded_batch
from flax import nnx
from test_gguf import write_gguf

import jaxlm
from jaxlm import ModelConfig
from jaxlm.models import model_class

# Each family: its transformers config class, model class and config of a tiny model (GQA
# with an odd group size), its GGUF architecture, and the real model whose plan is checked.
TINY = BASE | dict(
    hidden_size=72,
    num_attention_heads=9,
    num_key_value_heads=3,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FAMILIES = {
    "olmo2": dict(
        config="Olmo2Config",
        model="Olmo2ForCausalLM",
        tiny=dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
        arch=gguf.MODEL_ARCH.OLMO2,
    ),
    # A head size apart from hidden / heads, a window shorter than the prompts, and caps low
    # enough that the scores and logits reach them.
    "gemma2": dict(
        config="Gemma2Config",
        model="Gemma2ForCausalLM",
        tiny=dict(
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
        arch=gguf.MODEL_ARCH.GEMMA2,
        # llama.cpp scales Gemma 2's queries by the head size (see `_gemma_settings`).
        gguf_reference=dict(query_pre_attn_scalar=16),
        gguf_metadata=lambda writer, config: (
            writer.add_sliding_window(config.sliding_window),
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping),
            writer.add_final_logit_softcapping(config.final_logit_softcapping),
        ),
        # llama.cpp's converter stores Gemma's norm weights plus one.
        gguf_norm_shift=1.0,
    ),
    # Six layers, for llama.cpp's pattern of five sliding layers and a full one; the sliding
    # layers' RoPE base far from the full layers', whose rotation is also scaled.
    "gemma3": dict(
        config="Gemma3TextConfig",
        model="Gemma3ForCausalLM",
        tiny=dict(
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=20,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
            },
        ),
        arch=gguf.MODEL_ARCH.GEMMA3,
        gguf_reference=dict(query_pre_attn_scalar=16),
        gguf_metadata=lambda writer, config: (
            writer.add_sliding_window(config.sliding_window),
            writer.add_rope_freq_base_swa(
                config.rope_parameters["sliding_attention"]["rope_theta"]
            ),
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
            writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"]),
        ),
        gguf_norm_shift=1.0,
    ),
}
# Published parameter counts (the model cards' safetensors metadata on the Hub).
FULL_SIZE = {
    "OLMo-2-0425-1B": (
        1_484_916_736,
        dict(
            model_type="olmo2",
            vocab_size=100352,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            rope_theta=500000.0,
            max_position_embeddings=4096,
        ),
    ),
    "gemma-2-2b": (
        2_614_341_888,
        dict(
            model_type="gemma2",
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    # As its `config.json` on the Hub writes it, with the RoPE settings from before
    # transformers 5.
    "gemma-3-1b": (
        999_885_952,
        dict(
            model_type="gemma3_text",
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=None,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    # As its `config.json` on the Hub writes it, with its LongRoPE factors replaced by ones.
    "Phi-3.5-mini-instruct": (
        3_821_079_552,
        dict(
            model_type="phi3",
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            hidden_act="silu",
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=32000,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_theta=10000.0,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0] * 48,
                "long_factor": [1.0] * 48,
            },
            sliding_window=262144,
            attention_bias=False,
            tie_word_embeddings=False,
        ),
    ),
}
LENGTHS = [11, 4, 7]
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 50]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """A saved tiny model of each family: `(name, directory, transformers model)`."""
    name = request.param
    spec = FAMILIES[name]
    config = getattr(transformers, spec["config"])(**{**TINY, **spec["tiny"]})
    torch.manual_seed(0)
    hf = getattr(transformers, spec["model"])(config).eval()
    # Norms start at 1 (or 0 for Gemma's `1 + w`); random ones catch a norm swapped for another.
    # Larger query and key weights give scores large enough for Gemma's cap to act on.
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif key.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, path, hf


def write_family_gguf(path, name, hf):
    """`hf` as a float32 GGUF file under llama.cpp's tensor names and metadata keys."""
    config, spec = hf.config, FAMILIES[name]
    names = gguf.get_tensor_name_map(spec["arch"], config.num_hidden_layers)
    tensors = []
    for key, w in hf.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = w.numpy().astype(np.float32)
        if key.endswith("norm.weight"):
            w = w + np.float32(spec.get("gguf_norm_shift", 0.0))
        tensors.append((names.get_name(key, try_suffixes=(".weight", ".bias")), w, None))
    metadata = spec.get("gguf_metadata")
    hook = None if metadata is None else lambda writer: metadata(writer, config)
    return write_config_gguf(path, spec["arch"], tensors, hook, config)


def write_config_gguf(path, arch, tensors, metadata, config):
    """`tensors` as a GGUF file of architecture `arch` with the settings of a transformers
    `config`; `metadata(writer)`, if given, adds the family's own keys."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return write_gguf(
        path,
        gguf.MODEL_ARCH_NAMES[arch],
        tensors,
        metadata,
        layers=config.num_hidden_layers,
        ctx=config.max_position_embeddings,
        hidden=config.hidden_size,
        inter=config.intermediate_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        eps=config.rms_norm_eps,
        # Gemma 3's per-layer-type settings: the file's base is the full layers'.
        theta=config.rope_parameters.get("full_attention", config.rope_parameters)["rope_theta"],
        vocab=config.vocab_size,
        head_dim=None if head_dim == config.hidden_size // config.num_attention_heads else head_dim,
    )


def assert_parity(model, hf):
    for side in ("left", "right"):
        ids, mask, positions = padded_batch(hf.config.vocab_size, LENGTHS, side)
        ref = hf_logits(hf, ids, mask, positions)
        out = forward(model, ids, attention_mask=mask)
        real = mask.astype(bool)
        np.testing.assert_allclose(out[real], ref[real], atol=1e-4, rtol=0, err_msg=side)


def assert_same_greedy_tokens(model, hf, speculative=(None,)):
    """`generate`'s greedy tokens are transformers'; with each of `speculative`'s settings."""
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    for how in speculative:
        out = jaxlm.generate(
            model, None, [PROMPT], max_new_tokens=NEW_TOKENS, stop_token_ids=[], speculative=how
        )
        assert out[0].token_ids == ref[0, len(PROMPT) :].tolist(), how


def test_safetensors_equal_transformers(family):
    name, path, hf = family
    model, _ = jaxlm.load(path)
    assert type(model).__name__ == FAMILIES[name]["model"]
    assert_parity(model, hf)
    assert_same_greedy_tokens(model, hf, speculative=(None, "ngram"))


def test_gguf_equals_transformers(family, tmp_path):
    name, path, hf = family
    model, tokenizer = jaxlm.load(write_family_gguf(tmp_path / "m.gguf", name, hf))
    # The reference computes with the settings llama.cpp reads from the file.
    changes = FAMILIES[name].get("gguf_reference")
    if changes is not None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, **changes).eval()
    assert tokenizer is None
    assert type(model).__name__ == FAMILIES[name]["model"]
    assert_parity(model, hf)
    assert_same_greedy_tokens(model, hf)


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_plan_without_allocating(name):
    published, hf_config = FULL_SIZE[name]
    config = ModelConfig.from_hf_config(hf_config)
    assert config.num_parameters() == published
    gc.collect()
    live_before = len(jax.live_arrays())
    model = model_class(config).abstract(config, dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(nnx.state(model))
    assert sum(x.size for x in leaves) == published
    plan = jaxlm.plan(model, max_batch=2, max_seq_len=512, steps=("decode",))
    assert plan.weights_bytes == 2 * published
    c = config
    kv = 2 * c.num_hidden_layers * 2 * 512 * c.num_key_value_heads * c.head_dim * 2
    assert plan.kv_cache_bytes == kv
    # A budget a little above that plan's bill picks the same cache length.
    fitted = jaxlm.plan(model, max_batch=2, budget=plan.total_bytes + 1000, steps=("decode",))
    assert fitted.max_seq_len == 512
    gc.collect()
    assert len(jax.live_arrays()) <= live_before


def test_gemma2_refuses_another_activation():
    config = dict(FULL_SIZE["gemma-2-2b"][1], hidden_activation="gelu")
    with pytest.raises(jaxlm.LoadError, match="`hidden_activation`"):
        ModelConfig.from_hf_config(config)


def test_gemma3_reads_each_layer_types_rope():
    _, hf_config = FULL_SIZE["gemma-3-1b"]
    config = ModelConfig.from_hf_config(hf_config)
    assert (config.rope_theta, config.rope_local_base_freq) == (1e6, 1e4)
    assert (
        config.layer_types
        == (("sliding_attention",) * 5 + ("full_attention",)) * 4 + ("sliding_attention",) * 2
    )
    # transformers 5 writes the same settings keyed by layer type.
    new = transformers.Gemma3TextConfig(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 7.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 9.0},
        }
    ).to_dict()
    config = ModelConfig.from_hf_config(new)
    assert (config.rope_theta, config.rope_local_base_freq) == (9.0, 7.0)
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 8.0)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(use_bidirectional_attention=True), "`use_bidirectional_attention`"),
        (
            dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
            "`rope_parameters.sliding_attention.rope_type`",
        ),
        (dict(hidden_activation="gelu"), "`hidden_activation`"),
    ],
)
def test_gemma3_refuses_unimplemented_settings(change, field):
    with pytest.raises(jaxlm.LoadError, match=field):
        ModelConfig.from_hf_config(dict(FULL_SIZE["gemma-3-1b"][1], **change))
