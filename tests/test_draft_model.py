"""A draft model's drafts (`speculative=` a model): the tokens of `generate`, `stream` and
`LLMEngine` the same as without drafts, every draft of a draft that is the model itself kept,
and the plans' bills counting the draft model's weights and pages."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch
import transformers
from conftest import BASE, make_hf_model
from flax import nnx

import jaxlm
from jaxlm.batching.engine import LLMEngine
from jaxlm.batching.step import Shape
from jaxlm.errors import PlanError
from jaxlm.speculative import DRAFT

# Prompts that repeat themselves, as in `tests/test_speculative.py`.
LOOPS = [[5, 6, 7, 8] * 5, [9, 10, 11] * 4 + [9, 10]]
# The first token, then five chunks of a token and its drafts. The tests share this length and
# the default drafts, so that they share the steps compiled for them.
NEW_TOKENS = 1 + 5 * (DRAFT + 1)


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """The tiny Llama and a smaller random model of the same vocabulary to draft for it."""
    path = tmp_path_factory.mktemp("draft")
    make_hf_model(path, "llama_gqa3_tied_linear", seed=5)
    return jaxlm.load(tiny_llama[0])[0], jaxlm.load(path)[0]


@pytest.fixture(scope="module")
def planned(models):
    """A plan of the model with the draft model; prompts of `LOOPS`' bucket run its own
    executables."""
    model, draft = models
    return jaxlm.plan(model, max_batch=2, max_seq_len=64, prefill_chunk=32, speculative=draft)


def _tokens(outputs):
    return [o.token_ids for o in outputs]


def _alone(model, prompts, **kwargs):
    """`generate` of each prompt alone: a row drafts while it runs alone, as a draft model
    costs more than a chunk of drafts saves beside another (`jaxlm.batching.loop.busiest`)."""
    return [jaxlm.generate(model, None, prompt, **kwargs)[0] for prompt in prompts]


def _bytes(model) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(nnx.state(model)))


def test_a_draft_that_is_the_model_keeps_every_draft(models):
    model, _ = models
    kwargs = dict(max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    plain = jaxlm.generate(model, None, LOOPS, **kwargs)
    drafted = _alone(model, LOOPS, speculative=model, **kwargs)
    assert _tokens(drafted) == _tokens(plain)
    assert all(len(o.token_ids) == NEW_TOKENS for o in drafted)
    assert [o.drafted_tokens for o in drafted] == [o.accepted_tokens for o in drafted]
    assert [o.accepted_tokens for o in drafted] == [5 * DRAFT] * 2
    # A draft that is the model itself shares its weights: the plan counts them once.
    drafting = [p for p in jaxlm.plans_of(model) if p.generator.drafting]
    assert drafting and all(p.weights_bytes == _bytes(model) for p in drafting)


def test_another_draft_model_gives_the_same_tokens(models):
    model, draft = models
    kwargs = dict(max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    plain = jaxlm.generate(model, None, LOOPS, **kwargs)
    drafted = _alone(model, LOOPS, speculative=draft, **kwargs)
    assert _tokens(drafted) == _tokens(plain)
    assert all(0 <= o.accepted_tokens <= o.drafted_tokens for o in drafted)
    assert all(o.drafted_tokens > 0 and o.drafted_tokens % DRAFT == 0 for o in drafted)


def test_seeded_samples_are_the_same_with_a_draft_model(models):
    model, draft = models
    for temperature, top_k in ((0.002, 0), (1.0, 8), (0.002, 8)):
        sampled = dict(seed=7, temperature=temperature, top_k=top_k, stop_token_ids=[3])
        plain = _alone(model, LOOPS, max_new_tokens=NEW_TOKENS, **sampled)
        for drafter in (draft, model):
            drafted = _alone(
                model, LOOPS, max_new_tokens=NEW_TOKENS, speculative=drafter, **sampled
            )
            assert _tokens(drafted) == _tokens(plain)
            assert [o.finish_reason for o in drafted] == [o.finish_reason for o in plain]
    # Near zero, the samples are the greedy tokens: the model's own drafts were kept.
    assert min(o.accepted_tokens for o in drafted) > 0


def test_stream_with_a_draft_model_yields_the_text_of_generate(tiny_chat, tmp_path):
    model, tokenizer = jaxlm.load(tiny_chat)
    # A one-layer draft of the tokenizer's vocabulary.
    sizes = dict(vocab_size=model.config.vocab_size, hidden_size=32, num_hidden_layers=1)
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **sizes})).save_pretrained(
        tmp_path
    )
    draft, _ = jaxlm.load(tmp_path)
    prompt = "The capital of France is Paris. The capital of France is"
    kwargs = dict(max_new_tokens=24, stop_token_ids=[])
    (out,) = jaxlm.generate(model, tokenizer, prompt, **kwargs)
    # Calls of 5 tokens: the draft model's pages follow the tokens across the calls.
    pieces = list(
        jaxlm.stream(model, tokenizer, prompt, speculative=draft, chunk_tokens=5, **kwargs)
    )
    assert len([d for d in pieces if d.text]) > 1
    assert [t for d in pieces for t in d.token_ids] == out.token_ids
    assert "".join(d.text for d in pieces) == out.text
    assert pieces[-1].finish_reason == "length"
    # The plan with the draft model is the model's too: seen, holding its scratch, and freed.
    plans = jaxlm.plans_of(model)
    assert [p.generator.drafting for p in plans] == [False, True]
    drafted = plans[1]
    assert drafted.pooled and "draft" in {s.path[0] for s in drafted.layout.slots}
    plans.clear()
    assert len(jaxlm.plans_of(model)) == 0 and not drafted.pooled


def test_the_plan_bills_the_draft_model_and_runs_in_place(models, planned):
    model, draft = models
    plan = planned
    assert plan.weights_bytes == _bytes(model) + _bytes(draft)
    # Each model's keys and values, float32, for every slot of both rows.
    pages = lambda c: c.num_hidden_layers * 2 * 2 * 64 * c.num_key_value_heads * c.head_dim * 4
    assert plan.kv_cache_bytes == pages(model.config) + pages(draft.config)
    assert sorted(plan.compiled) == ["decode_draft", "generate_draft"]
    for executable in plan.executables.values():
        assert executable.alias == plan.scratch_bytes
    kwargs = dict(plan=plan, speculative=draft, stop_token_ids=[])
    jaxlm.generate(model, None, LOOPS, max_new_tokens=8, **kwargs)
    (held,) = plan._pool
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(held)]
    with jaxlm.CompileCounter() as compiles:
        out = jaxlm.generate(model, None, LOOPS[::-1], max_new_tokens=30, **kwargs)
    assert compiles.builds == 0
    assert _tokens(out) == _tokens(
        jaxlm.generate(model, None, LOOPS[::-1], max_new_tokens=30, stop_token_ids=[])
    )
    (held,) = plan._pool
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(held)] == pointers


def test_bad_draft_models_are_refused(models, planned, tiny_chat):
    model, draft = models
    other, _ = jaxlm.load(tiny_chat)
    vocabulary = f"needs the model's vocabulary of {model.config.vocab_size} tokens"
    with pytest.raises(ValueError, match=f"{vocabulary} .*, got one of {other.config.vocab_size}"):
        jaxlm.generate(model, None, [1, 2], max_new_tokens=2, speculative=other)
    with pytest.raises(ValueError, match=f"{vocabulary} .*, got no jaxlm model"):
        jaxlm.generate(
            model, None, [1, 2], max_new_tokens=2, speculative=nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        )
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    with pytest.raises(ValueError, match="`speculative` and `response_format`"):
        jaxlm.generate(
            model, None, [1, 2], max_new_tokens=2, speculative=draft, response_format=schema
        )
    with pytest.raises(PlanError, match="made for another model, or another draft model"):
        jaxlm.generate(model, None, [1, 2], max_new_tokens=2, plan=planned)
    with pytest.raises(PlanError, match="`prefill` and `decode` run a plan without a draft"):
        planned.prefill(planned.allocate(), [[1, 2]])
    with pytest.raises(ValueError, match="`steps` must name some of"):
        jaxlm.plan(model, max_batch=1, max_seq_len=32, speculative=draft, steps=("generate",))


# The engine's sizes, and prompts that repeat themselves and others, more than its slots.
SIZES = dict(max_num_seqs=4, page_size=4, num_pages=96, max_num_batched_tokens=16)
REQUESTS = [*LOOPS, [1, 2, 3] * 6, [40, 41] * 7, [3, 17, 29, 44, 2], list(range(30, 60))]


def _submit_all(engine, **kwargs):
    handles = [engine.submit(p, max_new_tokens=20, stop_token_ids=[], **kwargs) for p in REQUESTS]
    return [h.result(timeout=300) for h in handles]


@pytest.fixture(scope="module")
def sharp(models):
    """The model with sharper logits, so that samples fall into loops too, and the draft."""
    model, draft = models
    model = nnx.clone(model)
    model.lm_head.weight[...] = model.lm_head.weight[...] * 8
    return model, draft


def test_the_engines_draft_model_gives_the_tokens_it_gives_without(sharp):
    model, draft = sharp
    sampled = dict(temperature=0.7, seed=3)
    with LLMEngine(model, **SIZES) as e:
        plain, plain_sampled = _submit_all(e), _submit_all(e, **sampled)
    with LLMEngine(model, speculative=draft, **SIZES) as e:
        assert e.plan.speculative is draft
        assert _tokens(_submit_all(e)) == _tokens(plain)
        # One at a time, where a draft model as large as this one drafts (`drafting.busiest`).
        kw = dict(max_new_tokens=20, stop_token_ids=[])
        alone = [e.submit(p, **kw).result(timeout=300) for p in REQUESTS]
        assert _tokens(alone) == _tokens(plain)
        assert 0 < e.stats().accepted_tokens < e.stats().drafted_tokens
        assert _tokens(_submit_all(e, **sampled)) == _tokens(plain_sampled)
        # A request may decline to draft.
        (undrafted,) = [
            e.submit(REQUESTS[0], max_new_tokens=20, stop_token_ids=[], speculative=None)
        ]
        out = undrafted.result(timeout=300)
        assert out.token_ids == plain[0].token_ids and out.drafted_tokens == 0
        assert e.pools[0].num_in_use == 0
        with pytest.raises(ValueError, match="this engine drafts with its draft model"):
            e.submit([1, 2], max_new_tokens=2, speculative="ngram")


def test_an_engine_whose_draft_is_the_model_keeps_every_draft_in_place(sharp):
    model, _ = sharp
    with LLMEngine(model, **SIZES) as e:
        plain = _submit_all(e)
    with LLMEngine(model, speculative=model, **SIZES) as e:
        # A draft that is the model itself shares its weights: the plan counts them once.
        assert e.plan.weights_bytes == _bytes(model)
        step = Shape(0, 0, DRAFT)
        assert e.plan.executables[step].alias >= e.plan.scratch_bytes
        k_shape = e.pages["draft"]["model"]["layers"][0]["self_attn"]["k_pages"].shape
        shape = "f32[" + ",".join(map(str, k_shape)) + "]"
        assert not re.search(rf"= {re.escape(shape)}\S* copy\(", e.compiled[step].as_text())
        before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(e.pages)]
        with jaxlm.CompileCounter() as compiles:
            out = _submit_all(e)
        assert compiles.builds == 0
        assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(e.pages)] == before
    assert _tokens(out) == _tokens(plain)
    assert [o.drafted_tokens for o in out] == [o.accepted_tokens for o in out]
    assert sum(o.accepted_tokens for o in out) > 0


def test_the_engines_plan_bills_the_draft_models_weights_and_pages(models):
    model, draft = models
    plan = jaxlm.plan(model, **SIZES, speculative=draft)
    assert plan.weights_bytes == _bytes(model) + _bytes(draft)
    # Each model's keys and values, float32, in every page.
    pages = lambda c: c.num_hidden_layers * 2 * 96 * 4 * c.num_key_value_heads * c.head_dim * 4
    assert plan.scratch_bytes == pages(model.config) + pages(draft.config)
    with LLMEngine(model, plan=plan) as e:
        assert sum(x.nbytes for x in jax.tree.leaves(e.pages)) == plan.scratch_bytes
    with LLMEngine(model, **SIZES) as e, pytest.raises(ValueError, match="verifies drafts"):
        e.submit([1, 2], max_new_tokens=2, speculative=draft)
