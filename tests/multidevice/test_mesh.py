"""Sharded models on a mesh of 4 simulated CPU devices, against the same model on one device.

XLA fixes the number of host devices when it starts, so these tests run in a process of their
own with `XLA_FLAGS=--xla_force_host_platform_device_count=4` (`tests/test_sharding.py`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import forward, live_executables_after, make_hf_model
from jax.sharding import PartitionSpec as P

import jaxlm
from jaxlm.memory import format_bytes

MESHES = [(1, 4), (2, 2), (4, 1)]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [1, 2], [40, 41, 42, 43]]


def test_four_devices():
    assert jax.device_count() == 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny saved models: GQA 4:1 (2 KV heads), Qwen2 (tied, q/k/v biases), Qwen3 (q/k norms)."""
    paths = {}
    for family in ("llama_gqa4", "qwen2", "qwen3"):
        paths[family] = tmp_path_factory.mktemp(family)
        make_hf_model(paths[family], family)
    return paths


@pytest.fixture(scope="module")
def single(saved):
    """Logits and greedy tokens of each model on one device."""
    ids = np.random.default_rng(0).integers(0, 96, (4, 9))
    results = {}
    for family, path in saved.items():
        model, _ = jaxlm.load(path)
        out = jaxlm.generate(model, None, PROMPTS, max_new_tokens=12, stop_token_ids=[])
        results[family] = (ids, forward(model, ids), [o.token_ids for o in out])
    return results


# Llama on every mesh; Qwen2's biases and Qwen3's q/k norms on one that splits the heads each.
@pytest.mark.parametrize(
    "family, mesh",
    [("llama_gqa4", m) for m in MESHES] + [("qwen2", (2, 2)), ("qwen3", (1, 4))],
    ids=str,
)
def test_sharded_model_equals_single_device(saved, single, family, mesh):
    ids, logits, tokens = single[family]
    model, _ = jaxlm.load(saved[family], mesh=mesh)
    np.testing.assert_allclose(forward(model, ids), logits, atol=1e-5, rtol=0)
    out = jaxlm.generate(model, None, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert [o.token_ids for o in out] == tokens


def test_stream_on_a_mesh(tiny_chat):
    prompts = ["The capital of France", "Once upon a time"]
    kw = dict(max_new_tokens=20, stop_token_ids=[])
    model, tokenizer = jaxlm.load(tiny_chat)
    expected = jaxlm.generate(model, tokenizer, prompts, **kw)
    model, tokenizer = jaxlm.load(tiny_chat, mesh=(2, 2))
    pieces = list(jaxlm.stream(model, tokenizer, prompts, chunk_tokens=6, **kw))
    rows = list(zip(*pieces, strict=True))
    assert ["".join(d.text for d in row) for row in rows] == [o.text for o in expected]
    assert [[t for d in row for t in d.token_ids] for row in rows] == [
        o.token_ids for o in expected
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sharded_load_leaves_no_executables_behind(saved, dtype):
    # Bitcasting a bfloat16 embedding to its bits and checking each joined tensor's parts
    # ran as eager operations, whose executables JAX keeps for the life of the process.
    path = str(saved["llama_gqa4"])
    load = f"jaxlm.load({path!r}, dtype={dtype!r}, mesh=(1, 4), progress=False)"
    assert live_executables_after(load) == []


def test_shard_moves_a_loaded_model(saved, single):
    ids, logits, _ = single["qwen2"]
    model, _ = jaxlm.load(saved["qwen2"])
    sharded = jaxlm.shard(model, (2, 2))
    np.testing.assert_allclose(np.asarray(sharded(ids)), logits, atol=1e-5, rtol=0)
    qkv = sharded.model.layers[0].self_attn.qkv_proj.weight[...]
    assert qkv.sharding.spec == P("model", None, None)


def _by_device(arrays) -> dict:
    held: dict = {}
    for x in jax.tree.leaves(arrays):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def test_arrays_have_the_planned_sharding_and_bytes(saved):
    # 8 query heads and 2 KV heads on a (data=2, model=2) mesh: the KV heads split.
    model, _ = jaxlm.load(saved["llama_gqa4"], mesh=(2, 2))
    attn = model.model.layers[0].self_attn
    expected = [
        # Weights are `[out, in]`: column-parallel ones split their rows, row-parallel ones
        # their columns.
        # Queries, keys and values `[kv_heads, rows, in]`: each KV head's block of rows stays
        # whole on one device.
        (attn.qkv_proj.weight, P("model", None, None)),
        (attn.o_proj.weight, P(None, "model")),
        (model.model.layers[0].mlp.down_proj.weight, P(None, "model")),
        # Gate and up stacked `[2, out, in]`: each splits its rows.
        (model.model.layers[0].mlp.gate_up_proj.weight, P(None, "model", None)),
        (model.model.embed_tokens.weight, P("model", None)),
        (model.lm_head.weight, P("model", None)),
    ]
    for var, spec in expected:
        assert var[...].sharding.spec == spec
    assert model.model.norm.weight[...].sharding.is_fully_replicated
    # What is checked is the layout and the bytes, which no compiled step changes: the plan
    # compiles one step only.
    plan = jaxlm.plan(model, max_batch=2, max_seq_len=32, steps=("decode",))
    scratch = plan.allocate()
    for slot in plan.layout.slots:
        leaf = scratch
        for key in slot.path:
            leaf = leaf[key]
        assert leaf.sharding.is_equivalent_to(slot.sharding, len(slot.shape)), slot.path
    # Keys of layer 0: [2 pages (one per row), 2 KV heads, head_dim 8, 32 slots] float32 = 4096
    # bytes, one (row, head) block of 1024 bytes per device.
    k = scratch["model"]["layers"][0]["self_attn"]["k_pages"]
    assert k.shape == (2, 2, 8, 32)
    assert {s.data.shape for s in k.addressable_shards} == {(1, 1, 8, 32)}
    assert plan.kv_cache_bytes == 2 * 2 * 1024
    assert set(_by_device(scratch).values()) == {plan.scratch_bytes}
    assert set(_by_device(jax.tree.leaves(plan.generator.params)).values()) == {plan.weights_bytes}
    # Weights split 4 ways hold less than a whole copy per device.
    single = sum(x.nbytes for x in jax.tree.leaves(plan.generator.params))
    assert plan.weights_bytes < single
    assert "mesh data=2 x model=2" in str(plan)


def test_too_few_kv_heads_are_replicated(saved):
    # 2 KV heads cannot split 4 ways: every device keeps both, and the query heads that share
    # the KV heads' projection; the output projection still splits its columns.
    model, _ = jaxlm.load(saved["llama_gqa4"], mesh=(1, 4))
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight[...].sharding.spec == P(None, None, None)
    assert attn.o_proj.weight[...].sharding.spec == P(None, "model")
    plan = jaxlm.plan(model, max_batch=2, max_seq_len=32, steps=("decode",))
    k = plan.allocate()["model"]["layers"][0]["self_attn"]["k_pages"]
    assert {s.data.shape for s in k.addressable_shards} == {(2, 2, 8, 32)}
    assert "KV heads replicated over `model`" in str(plan)


def test_a_mesh_with_one_axis(saved, single):
    ids, logits, _ = single["llama_gqa4"]
    mesh = jax.make_mesh((4,), ("model",))
    model, _ = jaxlm.load(saved["llama_gqa4"], mesh=mesh)
    np.testing.assert_allclose(forward(model, ids), logits, atol=1e-5, rtol=0)
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=32, steps=("decode",))
    assert plan.layout.slots[0].sharding.mesh.axis_names == ("model",)


def _pointers(scratch) -> list:
    return [
        sorted(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
        for x in jax.tree.leaves(scratch)
    ]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_donation_keeps_every_shard_in_place(saved, mesh):
    model, _ = jaxlm.load(saved["llama_gqa4"], mesh=mesh)
    # `prefill` and `decode` run steps of their own; the plan's is the one `generate` compiled
    # for `PROMPTS` on this mesh (`test_sharded_model_equals_single_device`), loaded from the
    # compilation cache.
    plan = jaxlm.plan(model, max_batch=4, max_seq_len=32, prefill_chunk=16, steps=("generate",))
    scratch = plan.allocate()
    before = _pointers(scratch)
    scratch, logits = plan.prefill(scratch, np.array(PROMPTS[1:2] * 4))
    assert _pointers(scratch) == before
    scratch, _ = plan.decode(scratch, np.argmax(np.asarray(logits), -1))
    assert _pointers(scratch) == before


def test_model_axis_must_divide_the_heads(saved, tmp_path):
    make_hf_model(tmp_path, "llama_gqa3_tied_linear")  # 6 attention heads
    with pytest.raises(
        jaxlm.ShardingError, match=r"`model` has 4 devices.*`num_attention_heads=6`"
    ):
        jaxlm.load(tmp_path, mesh=(1, 4))
    model, _ = jaxlm.load(tmp_path)
    with pytest.raises(jaxlm.ShardingError, match="num_attention_heads=6"):
        jaxlm.shard(model, (1, 4))


def test_batch_must_divide_over_data(saved):
    model, _ = jaxlm.load(saved["llama_gqa4"], mesh=(4, 1))
    with pytest.raises(jaxlm.ShardingError, match=r"`max_batch=2`.*`data` \(4 devices\)"):
        jaxlm.plan(model, max_batch=2, max_seq_len=32)


# The model drafts for itself on `(2, 2)`; Qwen2 drafts for it on `(1, 4)`, where neither
# model's 2 KV heads split 4 ways, so both models' pages are replicated over `model`.
@pytest.mark.parametrize("mesh, drafter", [((2, 2), "llama_gqa4"), ((1, 4), "qwen2")], ids=str)
def test_a_draft_model_on_the_mesh_gives_the_single_device_tokens(saved, single, mesh, drafter):
    def drafted(mesh):
        # One prompt a call (beside the padding row of `data`), where a row drafts: beside
        # others, a draft model costs more than it saves (`jaxlm.batching.loop.busiest`).
        model, _ = jaxlm.load(saved["llama_gqa4"], mesh=mesh)
        draft = model if drafter == "llama_gqa4" else jaxlm.load(saved[drafter], mesh=mesh)[0]
        kw = dict(max_new_tokens=12, stop_token_ids=[], speculative=draft)
        out = [jaxlm.generate(model, None, p, **kw)[0] for p in PROMPTS]
        return [o.token_ids for o in out], [(o.drafted_tokens, o.accepted_tokens) for o in out]

    tokens, counts = drafted(mesh)
    assert tokens == single["llama_gqa4"][2]
    # As many drafted and kept as on one device; the model drafting for itself keeps some.
    assert counts == drafted(None)[1]
    assert all(n > 0 for n, _ in counts)
    if drafter == "llama_gqa4":
        assert all(kept > 0 for _, kept in counts)


def test_a_draft_model_elsewhere_than_the_model_is_refused(saved):
    model, _ = jaxlm.load(saved["llama_gqa4"], mesh=(1, 4))
    draft, _ = jaxlm.load(saved["qwen2"])
    other = jaxlm.shard(draft, (2, 2))
    for target, drafter in ((model, draft), (draft, model), (model, other)):
        with pytest.raises(ValueError, match="a draft model must lie where the model does"):
            jaxlm.generate(target, None, [1, 2], max_new_tokens=2, speculative=drafter)


def test_bad_mesh_shapes(saved):
    with pytest.raises(jaxlm.ShardingError, match="needs 6 devices, there are 4"):
        jaxlm.load(saved["llama_gqa4"], mesh=(2, 3))
    mesh = jax.make_mesh((4,), ("tensor",))
    with pytest.raises(jaxlm.ShardingError, match="axes must be named"):
        jaxlm.load(saved["llama_gqa4"], mesh=mesh)


def test_abstract_sharded_plan_equals_the_loaded_one(saved):
    from flax import nnx

    model, _ = jaxlm.load(saved["qwen3"], mesh=(2, 2))
    abstract = nnx.eval_shape(lambda: jaxlm.LlamaForCausalLM(model.config))
    abstract = jaxlm.shard(abstract, (2, 2))
    plans = [jaxlm.plan(m, max_batch=4, max_seq_len=64) for m in (model, abstract)]
    for name in ("weights_bytes", "scratch_bytes", "kv_cache_bytes", "total_bytes"):
        assert getattr(plans[0], name) == getattr(plans[1], name), name


def test_cli_plans_on_a_mesh(capsys):
    from jaxlm.cli import main

    # SmolLM2-135M: 30 layers, hidden 576, 9 query and 3 KV heads of 64, MLP width 1536, tied
    # vocabulary of 49152. A third of every projection and of the embedding on each device;
    # the norms whole.
    h, kv, mlp = 576, 3 * 64, 1536
    split = 30 * (2 * h * h + 2 * h * kv + 3 * h * mlp) + 49152 * h
    per_device = 4 * (split // 3 + 30 * 2 * h + h)
    # What is checked is the weights' bytes: the plan compiles the decode step alone.
    assert main(["plan", "--mesh", "1,3", "--max-seq-len", "256", "--steps", "decode"]) == 0
    out = capsys.readouterr().out
    assert "mesh data=1 x model=3 (3 devices; bytes are per device)" in out
    assert f"weights: {format_bytes(per_device)}\n" in out
    assert main(["plan", "--mesh", "1,4", "--max-seq-len", "256"]) == 2
    assert "`model` has 4 devices, which does not divide `num_attention_heads=9`" in (
        capsys.readouterr().err
    )


def test_budget_is_per_device(saved):
    single, _ = jaxlm.load(saved["llama_gqa4"])
    sharded, _ = jaxlm.load(saved["llama_gqa4"], mesh=(1, 4))
    # Each plan bills the decode step alone: the one step compiled, once per device count.
    kw = dict(max_batch=4, steps=("decode",))
    whole = jaxlm.plan(single, max_seq_len=256, **kw).total_bytes
    per_device = jaxlm.plan(sharded, max_seq_len=256, **kw).total_bytes
    assert per_device < whole
    budget = (whole + per_device) // 2
    with pytest.raises(jaxlm.PlanError, match="no `max_seq_len` fits"):
        jaxlm.plan(single, budget=budget, **kw)
    fitted = jaxlm.plan(sharded, budget=budget, **kw)
    assert fitted.max_seq_len == 256 and fitted.total_bytes <= budget
