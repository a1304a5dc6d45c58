"""4-bit weights (`jaxlm.quantize(model, "int4")`, `jaxlm.load(..., quantize="int4")`): GGUF
blocks kept exactly, the model against its own weights dequantized, quality on the real model,
the compiled step's temporaries, the plan's bytes, and bad input."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from test_gguf import TINY, tiny_llama_tensors, write_gguf
from test_int8 import Q8_0_KLD, Q8_0_TOP1

import jaxlm
from jaxlm.bench.quality import QUALITY_TEXT, divergence
from jaxlm.kernels import int4
from jaxlm.layers import Embedding, Linear
from jaxlm.models import model_class
from jaxlm.sharding import weights_bytes

Q = gguf.GGMLQuantizationType


def layers(model):
    return {path: m for path, m in jaxlm.quantization.quantized_params(model)}


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1], ids=str)
def test_gguf_4_bit_blocks_load_exactly(tmp_path, kind):
    rng = np.random.default_rng(0)

    def make(name, rows, cols):
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        return name, gguf.quants.quantize(data, kind), kind

    path = write_gguf(tmp_path / "m.gguf", "llama", tiny_llama_tensors(make, rng), **TINY)
    packed, _ = jaxlm.load(path, quantize="int4")
    # The float32 load decodes the blocks as `gguf.quants` does (`test_gguf.py`).
    floats = layers(jaxlm.load(path)[0])
    for name, module in layers(packed).items():
        w, s = module.weight[...], module.scale[...]
        if isinstance(module, Embedding):
            assert w.dtype == jnp.int8
            continue
        assert w.dtype == jnp.uint8 and s.dtype == jnp.float16, name
        expected = np.asarray(floats[name].weight[...])
        np.testing.assert_array_equal(np.asarray(int4.dequantize(w, s)), expected, err_msg=name)


def test_int4_model_computes_with_its_dequantized_weights(tiny_llama):
    path, _ = tiny_llama
    model, _ = jaxlm.load(path)
    ids = jnp.asarray([[1, 5, 9, 2, 7, 3]])
    quantized = jaxlm.quantize(jaxlm.load(path)[0], "int4")
    # The same model with each 4-bit weight's values in float32 and the int8 table's rows.
    for (_, q), (_, f) in zip(layers(quantized).items(), layers(model).items(), strict=True):
        if q.weight[...].dtype == jnp.uint8:
            f.weight.set_value(int4.dequantize(q.weight[...], q.scale[...]))
        else:
            rows = jnp.arange(q.weight[...].shape[0])
            f.weight.set_value(jaxlm.ops.quantized_rows(q.weight[...], q.scale[...], rows))
    expected = np.asarray(model(ids))
    got = np.asarray(quantized(ids))
    # The activations' rounding to int8 per block of 32 is all that differs.
    np.testing.assert_allclose(got, expected, atol=0.02 * np.abs(expected).max())
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.8


@pytest.fixture(scope="module")
def default_models():
    floats, tokenizer = jaxlm.load()
    return floats, jaxlm.load(quantize="int4")[0], tokenizer


def test_int4_of_the_shipped_file_is_as_close_to_its_float32_as_llama_cpp_q8_0(default_models):
    # The Q4_1 blocks are the float32 model's weights: what differs is the activations'
    # rounding, which must cost no more than llama.cpp's 8-bit weights do.
    floats, quantized, tokenizer = default_models
    ids = jnp.asarray([tokenizer.encode(QUALITY_TEXT)])
    kld, top1 = divergence(np.asarray(floats(ids)[0]), np.asarray(quantized(ids)[0]))
    assert kld <= Q8_0_KLD and top1 >= Q8_0_TOP1, (kld, top1)


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_a_decode_step_holds_no_unpacked_copy_of_a_weight(default_models, batch):
    floats, quantized, _ = default_models

    def temp(model):
        plan = jaxlm.plan(model, max_batch=batch, max_seq_len=256, steps=("decode",))
        return plan.executables["decode"].temp, plan.weights_bytes

    int4_temp, int4_weights = temp(quantized)
    smallest = min(m.weight[...].size for m in layers(quantized).values())
    # Beyond float32's temporaries (the logits and sampling's), less than the smallest weight.
    assert int4_temp - temp(floats)[0] < smallest
    if batch <= 2:
        assert int4_temp < 0.05 * int4_weights, (int4_temp, int4_weights)


def test_drafts_are_refused_on_4_bit_weights(default_models):
    # A chunk that verifies drafts and a single decode step differ in their last bits, which
    # activations rounded to one int8 digit make up to a logit: drafts would change the tokens.
    _, quantized, tokenizer = default_models
    refused = "`speculative` keeps the tokens of plain decoding with float or int8 weights"
    with pytest.raises(ValueError, match=refused):
        jaxlm.generate(quantized, tokenizer, "Hi", max_new_tokens=4, speculative="ngram")
    with pytest.raises(ValueError, match=refused):
        jaxlm.plan(quantized, max_seq_len=64, steps=("generate_ngram",))
    with pytest.raises(ValueError, match=refused):
        jaxlm.LLMEngine(quantized, tokenizer, num_pages=8, speculative="ngram")


def test_the_plan_bills_the_packed_bytes():
    config = jaxlm.ModelConfig.from_hf_config(
        dict(
            model_type="llama",
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    cls = model_class(config)
    floats, model = cls.abstract(config), cls.abstract(config, quantize="int4")
    expected = weights_bytes(floats)
    for module in layers(floats).values():
        shape = module.weight.get_value().shape
        rows, k = int(np.prod(shape[:-1])), shape[-1]
        expected -= 4 * rows * k
        # Half a byte a weight and two float16s a block of 32; the table in int8, a float32
        # scale a row.
        expected += rows * k // 2 + 4 * rows * k // 32 if isinstance(module, Linear) else 0
        expected += rows * k + 4 * rows if isinstance(module, Embedding) else 0
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=64, steps=("decode",))
    assert plan.weights_bytes == weights_bytes(model) == expected
