"""An int8 model on 4 simulated CPU devices (run by `tests/test_sharding.py`): its weights and
their scales split as a float model's, and it computes as on one device."""

from __future__ import annotations

import numpy as np
from conftest import forward, make_hf_model
from jax.sharding import PartitionSpec as P

import jaxlm

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


def test_int8_weights_split_with_their_scales(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    kw = dict(max_new_tokens=8, stop_token_ids=[])
    model, _ = jaxlm.load(tmp_path, quantize="int8")
    logits, outputs = forward(model, ids), jaxlm.generate(model, None, PROMPTS, **kw)
    model, _ = jaxlm.load(tmp_path, quantize="int8", mesh=(2, 2))
    mlp = model.model.layers[0].mlp
    # Column-parallel gate/up: the rows and their scales split; row-parallel down: its input.
    assert mlp.gate_up_proj.weight[...].sharding.spec == P(None, "model", None)
    assert mlp.gate_up_proj.scale[...].sharding.spec == P(None, "model")
    assert mlp.down_proj.weight[...].sharding.spec == P(None, "model")
    np.testing.assert_allclose(forward(model, ids), logits, atol=1e-4, rtol=0)
    # Every field of each output: its tokens, finish reason and prompt.
    assert jaxlm.generate(model, None, PROMPTS, **kw) == outputs
