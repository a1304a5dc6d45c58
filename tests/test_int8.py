"""int8 weights (`jaxlm.quantize`, `jaxlm.load(..., quantize="int8")`): the quantized product
against an independent computation, quality against float32 on the real model, the compiled
steps' temporaries, the plan's bytes, and bad input."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import BASE, forward, hf_logits, padded_batch
from flax import nnx
from test_gguf import TINY, random_blocks, tiny_llama_tensors, write_gguf

import jaxlm
from jaxlm import ops
from jaxlm.bench.quality import QUALITY_TEXT, divergence
from jaxlm.loading import checkpoint_tensors
from jaxlm.models import model_class
from jaxlm.sharding import weights_bytes

# llama.cpp's own `Q8_0` of SmolLM2 against its F32 copy, over 381 tokens of such text: the
# bar jaxlm's int8 of the shipped file must clear.
Q8_0_KLD, Q8_0_TOP1 = 0.0036, 0.969


def rotation(n: int) -> np.ndarray:
    """The orthogonal `[n, n]` that jaxlm's int8 weights are rotated by, built here as a
    matrix: random signs (NumPy's generator seeded with `n`), then a Sylvester Hadamard
    matrix on each block of the largest power of two up to 64 that divides `n`."""
    b = np.gcd(n, 64)
    h = np.array([[1.0]])
    while len(h) < b:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(n).choice(np.float32([-1, 1]), n)
    return np.kron(np.eye(n // b), h / np.sqrt(b)) @ np.diag(signs)


def two_digits(x: np.ndarray) -> np.ndarray:
    """Columns of `x` `[in, cols]` rounded as two int8 digits: the first to 127 steps of the
    column's largest magnitude, the second the remainder in steps 254 times finer."""
    x = x.astype(np.float32)
    step = np.abs(x).max(0) / np.float32(127)
    step = np.where(step == 0, np.float32(1), step)
    hi = np.round(x / step)
    lo = np.clip(np.round((x - hi * step) * (np.float32(254) / step)), -127, 127)
    return hi.astype(np.float64) * step + lo.astype(np.float64) * (step / 254.0)


@pytest.mark.parametrize("shape", [(48, 64), (3, 40, 112), (2, 24, 72)])
@pytest.mark.parametrize("cols", [1, 2, 5])
def test_product_equals_numpy(shape, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, np.float32)
    w[..., 3] *= 20  # an outlier input, which the rotation spreads over its block
    x = rng.standard_normal((shape[-1], cols), np.float32)
    q, scale = jax.jit(ops.quantize_weight)(jnp.asarray(w))
    rotated = w.astype(np.float64) @ rotation(shape[-1]).T
    expected_scale = np.abs(rotated).max(-1) / 127
    np.testing.assert_allclose(np.asarray(scale), expected_scale, rtol=1e-6)
    # Values halfway between two steps may round either way in float32.
    off = np.abs(np.asarray(q, np.int32) - np.round(rotated / expected_scale[..., None]))
    assert off.max() <= 1 and off.mean() < 1e-3
    y = jax.jit(ops.quantized_matmul)(q, scale, jnp.asarray(x))
    digits = two_digits((rotation(shape[-1]) @ x.astype(np.float64)).astype(np.float32))
    expected = np.einsum("...ok,kc->...oc", np.asarray(q, np.int64) * 1.0, digits)
    expected = expected * np.asarray(scale, np.float64)[..., None]
    np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-6, atol=2e-6 * np.abs(y).max())


def leaves(model):
    return jax.tree.leaves(nnx.state(model))


def quantized_reference(path, model):
    """transformers' model from `path` computing with `model`'s int8 weights: each weight
    dequantized (in float64), each linear layer rotating and rounding its input to two digits
    as jaxlm's product does, then multiplying in float64. The embedding table is rotated back
    for its rows."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    floats, _ = jaxlm.load(path)
    for (_, qmod), (_, fmod) in zip(
        jaxlm.quantization.quantized_params(model),
        jaxlm.quantization.quantized_params(floats),
        strict=True,
    ):
        deq = np.asarray(qmod.weight[...], np.float64) * np.asarray(qmod.scale[...])[..., None]
        if isinstance(qmod, jaxlm.layers.Embedding):
            deq = deq @ rotation(deq.shape[-1])
        fmod.weight = nnx.Param(jnp.asarray(deq, jnp.float32))
    weights = {k: torch.from_numpy(v.copy()) for k, v in checkpoint_tensors(floats).items()}
    tied = hf.config.tie_word_embeddings
    hf.load_state_dict(weights, strict=not tied)

    def product(module, args, out):
        # A forward hook: the output replaced by the quantized product's.
        (x,) = args
        flat = x.detach().numpy().reshape(-1, x.shape[-1]).T  # [in, tokens]
        r = rotation(flat.shape[0])
        w = module.weight.detach().numpy().astype(np.float64)
        if module is hf.get_output_embeddings() and tied:
            w = w @ r.T  # the table, in the rotated basis its int8 values are in
        y = (w @ two_digits((r @ flat).astype(np.float32))).T.astype(np.float32)
        return torch.from_numpy(y.reshape(*x.shape[:-1], -1))

    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(product)
    return hf


def test_int8_logits_equal_the_quantized_product_in_transformers(tiny_llama):
    path, _ = tiny_llama
    model, _ = jaxlm.load(path, quantize="int8")
    hf = quantized_reference(path, model)
    ids, mask, positions = padded_batch(hf.config.vocab_size, [9, 5], "left")
    ref = hf_logits(hf, ids, mask, positions)
    out = forward(model, ids, attention_mask=mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=1e-4, rtol=0)


def test_load_quantized_equals_quantize_after_loading(tiny_llama):
    path, _ = tiny_llama
    loaded, _ = jaxlm.load(path, quantize="int8")
    after = jaxlm.quantize(jaxlm.load(path)[0], "int8")
    for a, b in zip(leaves(loaded), leaves(after), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kinds = {p: m.weight[...].dtype for p, m in jaxlm.quantization.quantized_params(loaded)}
    assert set(kinds.values()) == {jnp.dtype(jnp.int8)}
    # Every projection of every layer, and the embedding table (tied to the LM head here).
    assert len(kinds) == 1 + 4 * loaded.config.num_hidden_layers + (
        0 if loaded.config.tie_word_embeddings else 1
    )


Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=str)
def test_gguf_blocks_load_into_int8_from_their_exact_values(tmp_path, kind):
    # Decoded on the device (Q8_0, Q4_0, Q4_1) or by `gguf.quants` (the K types), then
    # quantized: the same int8 as quantizing the float model the file gives.
    rng = np.random.default_rng(0)

    def make(name, rows, cols):
        if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            return name, random_blocks(kind, rows, cols, rng), kind
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        return name, gguf.quants.quantize(data, kind), kind

    path = write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_tensors(make, rng), **TINY)
    loaded, _ = jaxlm.load(path, quantize="int8")
    after = jaxlm.quantize(jaxlm.load(path)[0], "int8")
    for a, b in zip(leaves(loaded), leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def default_models():
    floats, tokenizer = jaxlm.load()
    return floats, jaxlm.load(quantize="int8")[0], tokenizer


def test_int8_of_the_shipped_file_is_as_close_to_float32_as_llama_cpp_q8_0(default_models):
    floats, quantized, tokenizer = default_models
    ids = jnp.asarray([tokenizer.encode(QUALITY_TEXT)])
    assert ids.shape[1] >= 300
    kld, top1 = divergence(np.asarray(floats(ids)[0]), np.asarray(quantized(ids)[0]))
    assert kld <= Q8_0_KLD and top1 >= Q8_0_TOP1, (kld, top1)


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_a_decode_step_holds_no_float_copy_of_a_weight(default_models, batch):
    floats, quantized, _ = default_models

    def temp(model):
        plan = jaxlm.plan(model, max_batch=batch, max_seq_len=256, steps=("decode",))
        return plan.executables["decode"].temp, plan.weights_bytes

    int8_temp, int8_weights = temp(quantized)
    # Beyond float32's step, whose temporaries are the logits and sampling's over the vocabulary
    # (at batch 8, 8% of SmolLM2's int8 weights), less than a float copy of the smallest weight.
    smallest = min(m.weight[...].size for _, m in jaxlm.quantization.quantized_params(quantized))
    assert int8_temp - temp(floats)[0] < 4 * smallest
    if batch <= 2:
        assert int8_temp < 0.05 * int8_weights, (int8_temp, int8_weights)


def test_prompts_of_one_bucket_compile_once(default_models):
    _, quantized, tokenizer = default_models
    jaxlm.generate(quantized, tokenizer, "The capital of France is", max_new_tokens=4)
    with jaxlm.CompileCounter() as counter:
        jaxlm.generate(quantized, tokenizer, "Name three colours:", max_new_tokens=4)
    assert counter.builds == 0


def test_the_plan_counts_int8_bytes_and_fits_a_longer_context():
    config = jaxlm.ModelConfig.from_hf_config(
        dict(
            model_type="llama",
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=1,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=131072,
        )
    )
    cls = model_class(config)
    floats = cls.abstract(config, dtype=jnp.bfloat16)
    quantized = cls.abstract(config, dtype=jnp.bfloat16, quantize="int8")
    c = config
    per_layer = [
        (c.num_key_value_heads, (c.num_kv_groups + 2) * c.head_dim),
        (c.hidden_size,),
        (2, c.intermediate_size),
        (c.hidden_size,),
    ]
    rows = c.vocab_size * 2 + c.num_hidden_layers * sum(int(np.prod(r)) for r in per_layer)
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    # One byte a weight, a float32 scale a row, the norms in bfloat16.
    expected = c.num_parameters() - norms + 4 * rows + 2 * norms
    # Room for float32's weights and 64 MiB: int8's free about half of the weights' bytes.
    budget = weights_bytes(floats) + (64 << 20)
    float_plan = jaxlm.plan(floats, max_batch=1, budget=budget, steps=("decode",))
    int8_plan = jaxlm.plan(quantized, max_batch=1, budget=budget, steps=("decode",))
    assert int8_plan.weights_bytes == expected
    assert int8_plan.max_seq_len > 2 * float_plan.max_seq_len


def test_bad_quantize_arguments(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="`quantize` must be None, `int8` or `int4`"):
        jaxlm.load(path, quantize="int3")
    with pytest.raises(ValueError, match="`dtype` float16"):
        jaxlm.load(path, quantize="int8", dtype=jnp.float16)
    model, _ = jaxlm.load(path)
    with pytest.raises(ValueError, match="`quantize` must be None, `int8` or `int4`"):
        jaxlm.quantize(model, "fp8")


def test_experts_are_refused_rather_than_left_in_float():
    config = jaxlm.ModelConfig.from_hf_config(
        dict(
            BASE,
            model_type="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
    )
    with pytest.raises(ValueError, match=r"`model\.layers\.0\.mlp\.experts\.\w+` is neither"):
        model_class(config).abstract(config, quantize="int8")
