"""A mixture of experts on 4 simulated CPU devices (run by `tests/test_sharding.py`): its
experts split over `model` where the axis divides them (expert parallelism), else replicated,
and the model computes as on one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers
from conftest import BASE, forward
from jax.sharding import PartitionSpec as P

import jaxlm
from jaxlm import ModelConfig
from jaxlm.models import model_class

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
TINY = dict(BASE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY))
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    hf.save_pretrained(path)
    return path


def _ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_experts_split_over_model_and_compute_as_on_one_device(saved):
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    kw = dict(max_new_tokens=8, stop_token_ids=[])
    model, _ = jaxlm.load(saved)
    # One row decodes with the chosen experts gathered, two with every expert.
    expected = [_ids(jaxlm.generate(model, None, p, **kw)) for p in (PROMPTS[:1], PROMPTS)]
    logits = forward(model, ids)
    model, _ = jaxlm.load(saved, mesh=(1, 4))
    experts = model.model.layers[0].mlp.experts
    for weight in (experts.gate_up_proj[...], experts.down_proj[...]):
        assert weight.sharding.spec == P("model", None, None)
        assert {s.data.shape[0] for s in weight.addressable_shards} == {2}
    np.testing.assert_allclose(forward(model, ids), logits, atol=1e-5, rtol=0)
    for prompts, tokens in zip((PROMPTS[:1], PROMPTS), expected, strict=True):
        assert _ids(jaxlm.generate(model, None, prompts, **kw)) == tokens
    # The plan counts each device's two experts of each layer. Its step is the one `generate`
    # compiled for the two prompts, loaded from the compilation cache.
    plan = jaxlm.plan(model, max_batch=2, max_seq_len=32, prefill_chunk=16, steps=("generate",))
    held = {}
    for x in jax.tree.leaves(plan.generator.params):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert set(held.values()) == {plan.weights_bytes}
    expert_bytes = 2 * 8 * 3 * 32 * 64 * 4
    assert plan.weights_bytes <= sum(x.nbytes for x in jax.tree.leaves(plan.generator.params)) - (
        expert_bytes * 3 // 4
    )


def test_experts_the_axis_does_not_divide_are_replicated():
    config = ModelConfig.from_hf_config(
        transformers.Qwen3MoeConfig(**dict(TINY, num_experts=6)).to_dict()
    )
    model = jaxlm.shard(model_class(config).abstract(config), (1, 4))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.get_value().sharding.spec == P(None, None, None)
