"""Prompt-lookup drafts (`speculative="ngram"`): the lookup against plain Python, and the
tokens of `generate` and `stream` the same with and without drafts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm import cli, ops, speculative
from jaxlm.errors import PlanError
from jaxlm.speculative import MAX_DRAFT, NGRAM_SIZES

# Prompts that repeat themselves, so that a tiny random model's continuations draft often.
LOOPS = [[5, 6, 7, 8] * 5, [9, 10, 11] * 4 + [9, 10]]


def lookup(row: list[int], index: int, draft: int) -> list[int] | None:
    """The drafts of a row whose text is `row[: index + 1]`, by the rule, in plain Python: the
    latest earlier occurrence of its last `n` tokens, longest `n` first, and what followed it,
    repeating with the occurrence's period past the row's end."""
    text = row[: index + 1]
    for n in NGRAM_SIZES:
        if len(text) < n:
            continue
        suffix = text[-n:]
        for j in range(len(text) - n - 1, -1, -1):
            if text[j : j + n] == suffix:
                follow = list(text[j + n :])
                while len(follow) < draft:
                    follow.append(follow[len(follow) - (len(text) - j - n)])
                return follow[:draft]
    return None


def test_drafts_are_what_followed_the_latest_earlier_occurrence():
    rng = np.random.default_rng(0)
    propose = jax.jit(speculative.propose, static_argnums=2)
    for vocab, draft in ((2, 1), (3, 3), (5, 6)):
        tokens = rng.integers(0, vocab, (64, 24)).astype(np.int32)
        # One last slot for every row, and one of each row's own.
        for index in (11, 23, rng.integers(0, 24, 64).astype(np.int32)):
            drafts, found = propose(jnp.asarray(tokens), jnp.asarray(index), draft)
            for b in range(64):
                at = int(np.broadcast_to(index, (64,))[b])
                want = lookup(tokens[b].tolist(), at, draft)
                assert bool(found[b]) == (want is not None), (vocab, index, b)
                if want is not None:
                    assert drafts[b].tolist() == want, (vocab, index, b)


def test_the_rows_keep_the_drafts_up_to_the_first_that_differs():
    drafts = jnp.array([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    sampled = jnp.array([[1, 2, 9, 0], [1, 2, 3, 7], [4, 0, 6, 1]])
    assert speculative.kept(sampled, drafts).tolist() == [2, 3, 1]


def _both(model, tokenizer, prompts, **kwargs):
    plain = jaxlm.generate(model, tokenizer, prompts, **kwargs)
    drafted = jaxlm.generate(model, tokenizer, prompts, speculative="ngram", **kwargs)
    return plain, drafted


@pytest.mark.parametrize("new_tokens", [7, 40])
def test_greedy_tokens_are_the_same_with_drafts(tiny_llama, new_tokens):
    model, _ = jaxlm.load(tiny_llama[0])
    for prompts in (LOOPS[:1], LOOPS):
        plain, drafted = _both(model, None, prompts, max_new_tokens=new_tokens, stop_token_ids=[])
        assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
        assert [o.finish_reason for o in drafted] == [o.finish_reason for o in plain]
        assert all(len(o.token_ids) == new_tokens for o in drafted)
    assert [o.drafted_tokens for o in plain] == [o.accepted_tokens for o in plain] == [0, 0]
    # A row keeps no more drafts than it made.
    assert all(0 <= o.accepted_tokens <= o.drafted_tokens for o in drafted)
    if new_tokens == 40:
        # The model fell into loops, drafted and kept drafts: the chunks' tokens were checked.
        assert min(o.accepted_tokens for o in drafted) > 0


def test_a_plan_with_drafts_holds_their_slots_and_no_more(tiny_llama):
    # Every step's attention reads every slot of the plan's cache: a bucket of the new tokens
    # and the drafts together would double it for a power of two of new tokens.
    model, _ = jaxlm.load(tiny_llama[0])
    kwargs = dict(max_new_tokens=16, stop_token_ids=[])
    plain = jaxlm.generate(model, None, LOOPS[:1], **kwargs)
    seq = jaxlm.plans_of(model)[0].max_seq_len
    drafted = jaxlm.generate(
        model, None, LOOPS[:1], speculative="ngram", num_speculative_tokens=3, **kwargs
    )
    assert jaxlm.plans_of(model)[0].num_speculative_tokens == 3
    assert jaxlm.plans_of(model)[0].max_seq_len == seq + 3
    assert drafted[0].token_ids == plain[0].token_ids


@pytest.mark.parametrize("drafts", [1, 5])
def test_every_draft_count_gives_the_same_tokens(tiny_llama, drafts):
    model, _ = jaxlm.load(tiny_llama[0])
    kwargs = dict(max_new_tokens=40, stop_token_ids=[])
    plain = jaxlm.generate(model, None, LOOPS, **kwargs)
    drafted = jaxlm.generate(
        model, None, LOOPS, speculative="ngram", num_speculative_tokens=drafts, **kwargs
    )
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    # Each chunk drafted `drafts` tokens, and some of them were kept.
    assert all(o.drafted_tokens > 0 and o.drafted_tokens % drafts == 0 for o in drafted)
    assert min(o.accepted_tokens for o in drafted) > 0


def test_int8_weights_give_the_same_tokens_with_drafts(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0], quantize="int8")
    plain, drafted = _both(model, None, LOOPS, max_new_tokens=40, stop_token_ids=[])
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert min(o.accepted_tokens for o in drafted) > 0


def test_seeded_samples_stop_tokens_and_penalties_are_the_same_with_drafts(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    # Sharper logits, so that samples fall into loops too.
    model.lm_head.weight[...] = model.lm_head.weight[...] * 8
    kwargs = dict(max_new_tokens=40, seed=7, stop_token_ids=[3])
    sampled = dict(temperature=[0.6, 1.0], top_k=[0, 8], top_p=[0.9, 1.0])
    plain, drafted = _both(model, None, LOOPS, **kwargs, **sampled)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in drafted] == [o.finish_reason for o in plain]
    assert max(o.drafted_tokens for o in drafted) > 0
    # Each position's penalty counts the drafts before it as the row's tokens.
    plain, drafted = _both(model, None, LOOPS, **kwargs, repetition_penalty=1.1)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert min(o.accepted_tokens for o in drafted) > 0


def test_stream_yields_the_text_of_generate(tiny_chat):
    model, tokenizer = jaxlm.load(tiny_chat)
    prompt = "The capital of France is Paris. The capital of France is"
    (out,) = jaxlm.generate(model, tokenizer, prompt, max_new_tokens=24, stop_token_ids=[])
    pieces = list(
        jaxlm.stream(
            model,
            tokenizer,
            prompt,
            max_new_tokens=24,
            stop_token_ids=[],
            speculative="ngram",
            num_speculative_tokens=2,
            chunk_tokens=5,
        )
    )
    assert len([d for d in pieces if d.text]) > 1
    assert "".join(d.text for d in pieces) == out.text
    # With drafts too, the deltas' tokens are generate's and the last one says why it ended.
    assert [t for d in pieces for t in d.token_ids] == out.token_ids
    assert pieces[-1].finish_reason == out.finish_reason == "length"
    # A stop string ends the row as it does without drafts.
    stop = out.text[5:8]
    plain, drafted = _both(model, tokenizer, prompt, max_new_tokens=24, stop=stop)
    assert [o.text for o in drafted] == [o.text for o in plain]
    assert [o.finish_reason for o in drafted] == [o.finish_reason for o in plain] == ["stop"]


def test_a_planned_request_drafts_in_place_without_compiling(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    steps = ("generate_ngram",)
    plan = jaxlm.plan(model, max_batch=2, max_seq_len=96, steps=steps, num_speculative_tokens=4)
    assert plan.num_speculative_tokens == 4
    kwargs = dict(plan=plan, stop_token_ids=[], speculative="ngram")
    first = jaxlm.generate(model, None, LOOPS, max_new_tokens=8, **kwargs)
    # A request drafts as many tokens a step as its plan does.
    assert all(o.drafted_tokens % 4 == 0 for o in first)
    with pytest.raises(PlanError, match="`num_speculative_tokens=2` differs from the plan's 4"):
        jaxlm.generate(model, None, LOOPS, max_new_tokens=8, num_speculative_tokens=2, **kwargs)
    (held,) = plan._pool
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(held)]
    with jaxlm.CompileCounter() as compiles:
        out = jaxlm.generate(model, None, LOOPS[::-1], max_new_tokens=33, **kwargs)
    assert compiles.builds == 0
    assert min(o.accepted_tokens for o in out) > 0
    (held,) = plan._pool
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(held)] == pointers


def test_bad_speculative_arguments_are_refused(tiny_llama):
    assert cli.SPECULATIVE == speculative.METHODS
    model, _ = jaxlm.load(tiny_llama[0])
    with pytest.raises(ValueError, match="`speculative` must be one of"):
        jaxlm.generate(model, None, [1, 2], max_new_tokens=2, speculative="eagle")
    for bad in (0, MAX_DRAFT + 1, 2.5, True, "3"):
        with pytest.raises(
            ValueError, match=f"`num_speculative_tokens` must be an integer from 1 to {MAX_DRAFT}"
        ):
            jaxlm.generate(
                model,
                None,
                [1, 2],
                max_new_tokens=2,
                speculative="ngram",
                num_speculative_tokens=bad,
            )
    with pytest.raises(ValueError, match="`num_speculative_tokens` needs `speculative`"):
        jaxlm.generate(model, None, [1, 2], max_new_tokens=2, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="`num_speculative_tokens` sizes the steps with drafts"):
        jaxlm.plan(model, max_batch=1, max_seq_len=32, num_speculative_tokens=2)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    with pytest.raises(ValueError, match="`speculative` and `response_format`"):
        jaxlm.generate(
            model, None, [1, 2], max_new_tokens=2, speculative="ngram", response_format=schema
        )


def test_a_drafted_chunk_attends_page_by_page_as_decoding_does():
    # Its logits then equal decoding's bit for bit (`jaxlm.ops.attention.attend`).
    assert MAX_DRAFT + 1 <= ops.attention.PAGE_BY_PAGE
