"""Mixtures of experts, Mixtral and Qwen3-MoE: parity with transformers from safetensors, in the
Hub's layout (a tensor per expert) and in transformers 5's own (stacked experts), and from GGUF
files written as llama.cpp's converter writes them; cached greedy decoding against
transformers' `generate` and from the paged engine; the plan of the real models built
abstractly; a decode step whose cost follows the experts it takes, not those it has."""

from __future__ import annotations

import gc

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import forward
from flax import nnx
from safetensors.numpy import load_file
from test_families import TINY, assert_parity, assert_same_greedy_tokens, write_config_gguf

import jaxlm
from jaxlm import ModelConfig
from jaxlm.batching.engine import LLMEngine
from jaxlm.loading import checkpoint_tensors
from jaxlm.models import model_class

# Each variant: transformers' config and model classes, a tiny model of 8 experts (GQA with an
# odd group size), and the GGUF architecture llama.cpp writes it as. Mixtral's window is shorter
# than the prompts.
MOE = {
    "mixtral": dict(
        config="MixtralConfig",
        model="MixtralForCausalLM",
        tiny=dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=4),
        arch=gguf.MODEL_ARCH.LLAMA,
    ),
    "qwen3_moe": dict(
        config="Qwen3MoeConfig",
        model="Qwen3MoeForCausalLM",
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            head_dim=16,
            norm_topk_prob=False,
        ),
        arch=gguf.MODEL_ARCH.QWEN3MOE,
    ),
    "qwen3_moe_normed": dict(
        config="Qwen3MoeConfig",
        model="Qwen3MoeForCausalLM",
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            head_dim=16,
            norm_topk_prob=True,
        ),
        arch=gguf.MODEL_ARCH.QWEN3MOE,
    ),
}
# The tensors of layer 0's last expert in the Hub's layout.
HUB_EXPERT = {
    "mixtral": "model.layers.0.block_sparse_moe.experts.7.w2.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.7.down_proj.weight",
    "qwen3_moe_normed": "model.layers.0.mlp.experts.7.down_proj.weight",
}
# Published parameter counts (the model cards' safetensors metadata on the Hub), with the
# models' `config.json`.
FULL_SIZE = {
    "Mixtral-8x7B-v0.1": (
        46_702_792_704,
        dict(
            model_type="mixtral",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1e6,
            sliding_window=None,
            router_jitter_noise=0.0,
            max_position_embeddings=32768,
        ),
    ),
    "Qwen3-30B-A3B": (
        30_532_122_624,
        dict(
            model_type="qwen3_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            sliding_window=None,
            rope_theta=1e6,
            max_position_embeddings=40960,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe(request, tmp_path_factory):
    """A saved tiny model of each variant: `(name, directory, transformers model)`."""
    name = request.param
    spec = MOE[name]
    config = getattr(transformers, spec["config"])(**{**TINY, **spec["tiny"]})
    torch.manual_seed(0)
    hf = getattr(transformers, spec["model"])(config).eval()
    # Random norms catch a norm swapped for another; a larger router makes its choices and
    # weights far from even, so that a wrong expert or weight shows.
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif key.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, path, hf


def test_safetensors_equal_transformers(moe):
    name, path, hf = moe
    # transformers 5 saves the Hub's layout, a tensor per expert.
    assert HUB_EXPERT[name] in load_file(path / "model.safetensors")
    model, _ = jaxlm.load(path)
    assert type(model).__name__ == MOE[name]["model"]
    assert_parity(model, hf)
    assert_same_greedy_tokens(model, hf, speculative=(None, "ngram"))


def test_stacked_experts_load_and_split_back(moe, tmp_path):
    name, path, hf = moe
    hf.save_pretrained(tmp_path, save_original_format=False)
    stacked = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked and HUB_EXPERT[name] not in stacked
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model, _ = jaxlm.load(tmp_path)
    ids = np.arange(20).reshape(2, 10)
    reference, _ = jaxlm.load(path)
    np.testing.assert_array_equal(forward(model, ids), forward(reference, ids))
    # The inverse of loading gives the Hub's tensors.
    hub = load_file(path / "model.safetensors")
    tensors = checkpoint_tensors(model)
    assert sorted(tensors) == sorted(hub)
    for key, value in hub.items():
        np.testing.assert_array_equal(tensors[key], value, err_msg=key)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's `LlamaModel.permute`: each head's rotate-half rows interleaved.
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, 2, rows, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(path, name, hf):
    """`hf` as a float32 GGUF file under llama.cpp's tensor names and metadata keys: each
    layer's experts stacked, `[experts, rows, columns]`, and for `llama`, Q and K permuted."""
    config, arch = hf.config, MOE[name]["arch"]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = []
    for key, w in hf.state_dict().items():
        w = w.numpy().astype(np.float32)
        if key.endswith("experts.gate_up_proj"):
            stem = key.removesuffix("gate_up_proj")
            for proj, part in zip(("gate_proj", "up_proj"), np.split(w, 2, axis=1), strict=True):
                tensors.append((names.get_name(stem + proj) + ".weight", part, None))
            continue
        if key.endswith("experts.down_proj"):
            tensors.append((names.get_name(key) + ".weight", w, None))
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in key else config.num_key_value_heads
            w = _permute(w, heads)
        tensors.append((names.get_name(key, try_suffixes=(".weight", ".bias")), w, None))

    def metadata(writer):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == gguf.MODEL_ARCH.QWEN3MOE:
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)

    return write_config_gguf(path, arch, tensors, metadata, config)


def test_gguf_equals_transformers(moe, tmp_path):
    name, path, hf = moe
    model, _ = jaxlm.load(write_moe_gguf(tmp_path / "m.gguf", name, hf))
    assert type(model).__name__ == MOE[name]["model"]
    # The reference computes as llama.cpp does: no window in `llama`, and the chosen experts'
    # weights renormalised.
    changes = dict(sliding_window=None) if name == "mixtral" else dict(norm_topk_prob=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, **changes).eval()
    assert_parity(model, hf)
    assert_same_greedy_tokens(model, hf)


@pytest.mark.parametrize("moe", ["mixtral"], indirect=True)
def test_paged_engine_equals_generate(moe):
    _, path, _ = moe
    model, _ = jaxlm.load(path)
    prompts = [[5, 17, 3, 88, 41, 9, 60], [2, 33, 71], [14, 50, 6, 7, 8, 9, 10, 11, 12, 13]]
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    expected = jaxlm.generate(model, None, prompts, **kw)
    # Prompts of at most 16 tokens, one or two chunks a step: 32 tokens a step compile every
    # shape they run, where the default 256 compiled six more.
    sizes = dict(max_num_seqs=2, page_size=4, num_pages=32, max_num_batched_tokens=32)
    with LLMEngine(model, **sizes) as engine:
        got = engine.generate(prompts, **kw)
    assert [r.token_ids for r in got] == [o.token_ids for o in expected]
    assert [r.finish_reason for r in got] == [o.finish_reason for o in expected]
    assert [r.prompt_token_ids for r in got] == [o.prompt_token_ids for o in expected] == prompts


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
    # One row: a decode step compiles each row's chosen experts, slowly at this size.
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=512, steps=("decode",))
    assert plan.weights_bytes == 2 * published
    c = config
    assert (
        plan.kv_cache_bytes
        == c.num_hidden_layers * 2 * 512 * c.num_key_value_heads * c.head_dim * 2
    )
    fitted = jaxlm.plan(model, max_batch=1, budget=plan.total_bytes + 1000, steps=("decode",))
    assert fitted.max_seq_len == 512
    gc.collect()
    assert len(jax.live_arrays()) <= live_before


def _decode_flops(experts: int, top_k: int) -> float:
    """The FLOPs XLA counts in one compiled decode step, batch 1, of a one-layer model whose
    experts are wide next to everything else."""
    config = ModelConfig.from_hf_config(
        dict(
            FULL_SIZE["Qwen3-30B-A3B"][1],
            vocab_size=64,
            hidden_size=256,
            moe_intermediate_size=1024,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=experts,
            num_experts_per_tok=top_k,
        )
    )
    model = model_class(config).abstract(config)
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=256, steps=("decode",))
    return plan.compiled["decode"].cost_analysis()["flops"]


def test_decode_cost_follows_top_k_not_the_experts():
    two_of_16, two_of_32, four_of_16 = (
        _decode_flops(16, 2),
        _decode_flops(32, 2),
        _decode_flops(16, 4),
    )
    # Only the router grows with the experts.
    assert two_of_32 == pytest.approx(two_of_16, rel=0.05)
    assert four_of_16 > 1.6 * two_of_16


def test_ignores_training_only_fields():
    config = ModelConfig.from_hf_config(
        dict(FULL_SIZE["Mixtral-8x7B-v0.1"][1], router_jitter_noise=0.1, output_router_logits=True)
    )
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)


@pytest.mark.parametrize(
    "name, change, field",
    [
        ("Qwen3-30B-A3B", dict(decoder_sparse_step=2), "`decoder_sparse_step`"),
        ("Qwen3-30B-A3B", dict(mlp_only_layers=[0, 47]), "`mlp_only_layers`"),
        ("Qwen3-30B-A3B", dict(use_sliding_window=True), "`use_sliding_window`"),
        ("Qwen3-30B-A3B", dict(num_experts_per_tok=129), "`num_experts_per_tok`"),
        ("Qwen3-30B-A3B", dict(num_experts=None), "`num_experts`"),
        ("Mixtral-8x7B-v0.1", dict(num_local_experts=0), "`num_local_experts`"),
        ("Mixtral-8x7B-v0.1", dict(hidden_act="gelu"), "`hidden_act`"),
    ],
)
def test_refuses_unsupported_settings(name, change, field):
    with pytest.raises(jaxlm.LoadError, match=field):
        ModelConfig.from_hf_config(dict(FULL_SIZE[name][1], **change))
