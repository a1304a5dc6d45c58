"""Parity with transformers on tiny random models, parameter counts, and loading errors."""

from __future__ import annotations

import gc
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
    BASE,
    FAMILIES,
    LLAMA_31_8B,
    hf_logits,
    live_executables_after,
    make_hf_model,
    padded_batch,
    rewrite_config,
)
from flax import nnx

import jaxlm
from jaxlm import LlamaForCausalLM, ModelConfig
from jaxlm.ops import matmul

LENGTHS = [9, 4, 6]


def assert_parity(model, hf, side, atol=1e-4, lengths=LENGTHS):
    ids, mask, positions = padded_batch(hf.config.vocab_size, lengths, side)
    ref = hf_logits(hf, ids, mask, positions)
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=atol, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_equal_transformers(tmp_path, family, side):
    hf = make_hf_model(tmp_path, family)
    model, tokenizer = jaxlm.load(tmp_path)
    assert tokenizer is None
    assert_parity(model, hf, side)


def test_dynamic_rope_beyond_the_trained_length(tmp_path):
    # `max_position_embeddings` is 8, so a 20-token batch exercises the NTK base change.
    hf = make_hf_model(tmp_path, "llama_dynamic")
    model, _ = jaxlm.load(tmp_path)
    assert_parity(model, hf, "right", lengths=[20, 11, 3])


def test_sliding_window_masks_old_tokens(tmp_path):
    hf = make_hf_model(tmp_path, "mistral_window")
    model, _ = jaxlm.load(tmp_path)
    assert model.config.sliding_window == 4
    assert_parity(model, hf, "left", lengths=[12, 7, 5])


def test_old_style_rope_config(tmp_path):
    # Checkpoints made before transformers 5 carry top-level `rope_theta` and `rope_scaling`.
    hf = make_hf_model(tmp_path, "llama3_scaling")
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = jaxlm.load(tmp_path)
    assert model.config.rope_scaling.rope_type == "llama3"
    assert model.config.rope_theta == 50000.0
    assert_parity(model, hf, "left")


def test_sharded_checkpoint(tmp_path):
    hf = make_hf_model(tmp_path, "llama_gqa4", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model, _ = jaxlm.load(tmp_path)
    assert_parity(model, hf, "left")


def test_bf16_checkpoint_loaded_as_float32(tmp_path):
    hf = make_hf_model(tmp_path, "qwen3", dtype=torch.bfloat16)
    model, _ = jaxlm.load(tmp_path, dtype=jnp.float32)
    assert_parity(model, hf, "right")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_a_checkpoint_leaves_no_executables_behind(tmp_path, dtype):
    # Reading tensors as JAX arrays (safetensors' `flax` frontend) compiled an identity for
    # each tensor shape, which JAX kept for the life of the process.
    make_hf_model(tmp_path, "llama_gqa4", dtype=getattr(torch, dtype))
    load = f"jaxlm.load({str(tmp_path)!r}, dtype={dtype!r}, progress=False)"
    assert live_executables_after(load) == []


def test_bfloat16_model(tmp_path):
    hf = make_hf_model(tmp_path, "llama_gqa4", dtype=torch.bfloat16)
    model, _ = jaxlm.load(tmp_path, dtype=jnp.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == jnp.bfloat16
    # The weights are exact (bf16 in both); jaxlm rounds each matmul's input to bf16 and
    # accumulates in f32, so each of the ~8 matmuls on a logit's path adds a relative error of
    # at most 2**-8 on activations of order 1; logits of these tiny models are of order 0.1-1.
    # 3e-2 is about four times that worst-case bound summed, and 100x below a wrong model.
    ids, mask, positions = padded_batch(hf.config.vocab_size, LENGTHS, "left")
    ref = hf_logits(hf, ids, mask, positions)
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=3e-2, rtol=0)
    assert np.abs(ref[real]).max() > 0.3


def test_positions_default_to_each_rows_first_token(tiny_llama):
    path, hf = tiny_llama
    model, _ = jaxlm.load(path)
    ids, mask, positions = padded_batch(hf.config.vocab_size, LENGTHS, "left")
    explicit = model(ids, positions=positions, attention_mask=mask)
    default = model(ids, attention_mask=mask)
    np.testing.assert_array_equal(np.asarray(explicit), np.asarray(default))


def test_a_step_traces_one_layer_for_all_layers(tmp_path):
    config = ModelConfig.from_hf_config(make_hf_model(tmp_path, "llama_gqa4").config.to_dict())
    model = LlamaForCausalLM.abstract(config)
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=16, steps=("decode",))
    generator = plan.generator
    x = generator.abstract_inputs(1, 4)
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), generator.params)
    jaxpr = (
        generator.steps["decode"]
        .trace(params, plan.layout.abstract(), x["params"], x["stops"], x["limit"])
        .jaxpr
    )

    def eqns(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        yield from eqns(sub.jaxpr)

    calls = [eqn.params["jaxpr"] for eqn in eqns(jaxpr.jaxpr) if eqn.params.get("name") == "_layer"]
    # The decode loop's body runs one step: one call per layer, all to one traced layer.
    assert len(calls) == config.num_hidden_layers > 1
    assert len({id(c) for c in calls}) == 1


@pytest.mark.parametrize(("step", "computed"), [("decode", 1), ("generate", 2)])
def test_a_step_computes_the_rotary_angles_once(tmp_path, step, computed):
    config = ModelConfig.from_hf_config(make_hf_model(tmp_path, "llama_gqa4").config.to_dict())
    plan = jaxlm.plan(LlamaForCausalLM.abstract(config), max_batch=1, max_seq_len=16, steps=(step,))
    hlo = plan.compiled[step].as_text()
    # One cosine and one sine of the step's positions, not one per query and key of each layer:
    # `generate` computes them for its prompt's one chunk (whose first slot is the constant 0)
    # and in its decode loop.
    assert config.num_hidden_layers > 1
    assert len(re.findall(r" cosine\(", hlo)) == len(re.findall(r" sine\(", hlo)) == computed


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_multiplies_with_the_weights_on_the_left(tmp_path, dtype):
    # YNNPACK streams a matmul's left operand as stored and repacks its right one at every
    # call, so the weights are the left operands: each projection's product is `[out, rows]`,
    # queries, keys and values one product, gate and up another. Nine rows: more than the
    # native kernel takes of a bfloat16 product (`jaxlm.ops.matmul`), so XLA's products run.
    config = ModelConfig.from_hf_config(make_hf_model(tmp_path, "llama_gqa4").config.to_dict())
    model = LlamaForCausalLM.abstract(config, dtype=dtype)
    plan = jaxlm.plan(model, max_batch=9, max_seq_len=16, steps=("decode",))
    dots = re.findall(r"= f32\[(\d+),(\d+)\]\S* dot\(", plan.compiled["decode"].as_text())
    c = config
    qkv = c.num_key_value_heads * (c.num_kv_groups + 2) * c.head_dim
    widths = {c.hidden_size, qkv, 2 * c.intermediate_size, c.vocab_size}
    assert {(int(n), int(m)) for n, m in dots} == {(n, 9) for n in widths}


@pytest.mark.parametrize("out_features", [576, 192, 3072, 100])
def test_a_one_row_matmul_is_spread_over_the_cpu_threads(out_features):
    # `matmul` makes a matrix-vector product a batched dot of 8 parts of the matrix, which the
    # CPU threads share, where 8 divides its rows (100 does not: one dot).
    threads = len(os.sched_getaffinity(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((576, 1, 1), np.float32)
    w = rng.standard_normal((out_features, 576), np.float32)
    parts = 8 if threads > 1 and out_features % 8 == 0 else 1
    hlo = jax.jit(matmul).lower(w, x).compile().as_text()
    dots = re.findall(r"= f32\[([\d,]+)\]\S* dot\(", hlo)
    assert dots == ([f"{parts},{out_features // parts},1"] if parts > 1 else [f"{out_features},1"])
    expected = np.einsum("ok,kbt->obt", w, x)
    np.testing.assert_allclose(jax.jit(matmul)(w, x), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("batch", "tokens"), [(1, 128), (2, 40), (2, 128), (1, 32), (1, 63), (3, 128)]
)
def test_a_prompt_chunk_runs_the_mlp_in_two_halves(batch, tokens):
    # On a CPU with several threads, for 64 to 256 even columns, each half of the chunk's
    # tokens goes through the three products of the MLP on its own.
    from jaxlm.layers import MLP

    config = ModelConfig.from_hf_config(dict(BASE, model_type="llama"))
    h, i = config.hidden_size, config.intermediate_size
    mlp = MLP(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((h, batch, tokens), np.float32)
    graphdef, state = nnx.split(mlp)
    run = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    cols = batch * tokens
    halves = len(os.sched_getaffinity(0)) > 1 and 64 <= cols <= 256 and cols % 2 == 0
    dots = re.findall(r"= f32\[([\d,]+)\]\S* dot\(", run.lower(state, x).compile().as_text())
    n = cols // 2 if halves else cols
    assert sorted(dots) == sorted([f"{2 * i},{n}", f"{h},{n}"] * (2 if halves else 1))
    weights = nnx.state(mlp, nnx.Param)
    w_gate, w_up = np.asarray(weights["gate_up_proj"]["weight"][...])
    w_down = np.asarray(weights["down_proj"]["weight"][...])
    gate = np.einsum("ik,kbt->ibt", w_gate, x)
    up = np.einsum("ik,kbt->ibt", w_up, x)
    expected = np.einsum("oi,ibt->obt", w_down, gate / (1 + np.exp(-gate)) * up)
    np.testing.assert_allclose(run(state, x), expected, rtol=1e-5, atol=1e-5)


FULL_SIZE = {
    # Published parameter counts (model cards / safetensors metadata on the Hub).
    "Llama-3.1-8B": (8_030_261_248, LLAMA_31_8B),
    "Qwen2.5-7B": (
        7_615_616_512,
        dict(
            model_type="qwen2",
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            rope_theta=1000000.0,
        ),
    ),
    "Qwen3-8B": (
        8_190_735_360,
        dict(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rope_theta=1000000.0,
        ),
    ),
    "SmolLM2-135M": (
        134_515_008,
        dict(
            model_type="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_parameter_counts_without_allocating(name):
    published, hf_config = FULL_SIZE[name]
    config = ModelConfig.from_hf_config(hf_config)
    gc.collect()
    live_before = len(jax.live_arrays())
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.bfloat16))
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) == published
    assert config.num_parameters() == published
    # `abstract` skips tracing the initialisers and builds the same structure.
    fast = LlamaForCausalLM.abstract(config, dtype=jnp.bfloat16)
    assert nnx.graphdef(fast) == nnx.graphdef(abstract)
    assert jax.tree.leaves(nnx.state(fast)) == leaves
    gc.collect()
    assert len(jax.live_arrays()) == live_before


# Bad input.


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        jaxlm.load(tmp_path)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        jaxlm.load("/no-such-dir")


def test_corrupt_safetensors(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(jaxlm.LoadError, match=r"model\.safetensors"):
        jaxlm.load(tmp_path)


def test_truncated_safetensors(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(jaxlm.LoadError, match=r"model\.safetensors"):
        jaxlm.load(tmp_path)


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path, "llama_gqa4")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(jaxlm.LoadError, match=r"`model\.layers\.1\.mlp\.up_proj\.weight`"):
        jaxlm.load(tmp_path)


def test_unexpected_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path, "llama_gqa4")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(jaxlm.LoadError, match=r"unexpected tensors `model\.extra\.weight`"):
        jaxlm.load(tmp_path)


def test_shape_mismatch(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path, "llama_gqa4")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(jaxlm.LoadError, match=r"`model\.norm\.weight` has shape \[3\]"):
        jaxlm.load(tmp_path)


@pytest.mark.parametrize("tensor", ["mlp.gate_proj", "self_attn.v_proj"])
def test_shape_mismatch_in_a_joined_parameter_names_the_checkpoint_tensor(tmp_path, tensor):
    from safetensors.torch import load_file, save_file

    # Gate and up load into one stacked parameter, q, k and v into one grouped by KV head; the
    # error names the tensor and its own shape.
    make_hf_model(tmp_path, "llama_gqa4")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    name = f"model.layers.1.{tensor}.weight"
    rows, cols = tensors[name].shape
    tensors[name] = tensors[name].T.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        jaxlm.LoadError,
        match=rf"`{re.escape(name)}` has shape \[{cols}, {rows}\], "
        rf"the config needs \[{rows}, {cols}\]",
    ):
        jaxlm.load(tmp_path)


def test_unsupported_model_type(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    rewrite_config(tmp_path, model_type="gpt2")
    with pytest.raises(jaxlm.LoadError, match=r"unsupported `model_type` 'gpt2'"):
        jaxlm.load(tmp_path)


def test_config_with_wrong_types(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    rewrite_config(tmp_path, hidden_size="64")
    with pytest.raises(jaxlm.LoadError, match="`hidden_size` must be a positive integer"):
        jaxlm.load(tmp_path)


def test_config_missing_keys(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(jaxlm.LoadError, match="lacks `num_hidden_layers`"):
        jaxlm.load(tmp_path)


def test_unsupported_rope_type():
    with pytest.raises(jaxlm.LoadError, match="unsupported RoPE scaling type 'yarn'"):
        ModelConfig.from_hf_config(
            dict(FULL_SIZE["SmolLM2-135M"][1], rope_scaling={"rope_type": "yarn", "factor": 4.0})
        )


def test_unsupported_activation():
    with pytest.raises(jaxlm.LoadError, match="`hidden_act`"):
        ModelConfig.from_hf_config(dict(FULL_SIZE["SmolLM2-135M"][1], hidden_act="gelu"))


def test_bad_dtype(tiny_llama):
    with pytest.raises(ValueError, match="`dtype`"):
        jaxlm.load(tiny_llama[0], dtype=jnp.int8)
