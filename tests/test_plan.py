"""The static memory plan: declarations, cached decode, donation in place, accounting, budgets."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import BASE, LLAMA_31_8B, make_hf_model
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxlm
from jaxlm import LlamaForCausalLM, ModelConfig, PlanError, stops
from jaxlm.batching.sampled import MAX_LOGIT_BIAS
from jaxlm.memory import declarations, format_bytes, parse_bytes

LENGTHS = [7, 3, 5]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_llama")
    make_hf_model(path, "llama_gqa4")
    model, _ = jaxlm.load(path)
    return model


def left_padded(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    t = max(lengths)
    prompt = rng.integers(0, vocab, (len(lengths), t)).astype(np.int32)
    return prompt, np.asarray(lengths, np.int32)


@pytest.mark.parametrize(
    "family,dtype",
    [
        ("llama_gqa4", jnp.float32),
        ("qwen3", jnp.float32),
        ("qwen2", jnp.float32),
        ("mistral_window", jnp.float32),
        ("llama_gqa4", jnp.bfloat16),
    ],
)
def test_cached_decode_equals_full_forward(tmp_path, family, dtype):
    make_hf_model(tmp_path, family, dtype=torch.float32)
    model, _ = jaxlm.load(tmp_path, dtype=dtype)
    vocab = model.config.vocab_size
    prompt, lengths = left_padded(LENGTHS, vocab)
    t = prompt.shape[1]
    steps = 16
    plan = jaxlm.plan(model, max_batch=3, max_seq_len=t + steps)
    scratch = plan.allocate()
    scratch, logits = plan.prefill(scratch, prompt, lengths)
    fed = np.random.default_rng(1).integers(0, vocab, (3, steps)).astype(np.int32)
    sequence = np.concatenate([prompt, fed], axis=1)
    mask = np.concatenate([np.arange(t)[None] >= (t - lengths)[:, None], np.ones_like(fed)], 1)
    full = np.asarray(model(sequence, attention_mask=mask))
    # bf16: both paths round k/v and matmul inputs alike; only the summation order differs.
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(logits), full[:, t - 1], atol=atol, rtol=0)
    for i in range(steps):
        scratch, logits = plan.decode(scratch, fed[:, i])
        np.testing.assert_allclose(np.asarray(logits), full[:, t + i], atol=atol, rtol=0)


def test_declarations_are_static_and_abstract(tiny):
    config = tiny.config
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config))
    real = list(declarations(tiny))
    assert real == list(declarations(abstract))
    attn = tiny.model.layers[0].self_attn
    nkv, d = config.num_key_value_heads, config.head_dim
    assert attn.k_pages.shape == ("num_pages", nkv, d, "page_size")
    assert attn.v_pages.shape == ("num_pages", nkv, "page_size", d)
    assert len(real) == 2 * config.num_hidden_layers
    # Declaring allocates nothing: the model's state holds only its parameters.
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(tiny)))
    assert n_params == config.num_parameters()


def test_planned_bytes_equal_allocated_bytes(tiny):
    plan = jaxlm.plan(tiny, max_batch=2, max_seq_len=48)
    gc.collect()
    live_before = len(jax.live_arrays())
    scratch = plan.allocate()
    leaves = jax.tree.leaves(scratch)
    assert sum(x.nbytes for x in leaves) == plan.scratch_bytes
    assert (
        len(jax.live_arrays()) == live_before + len(plan.layout.slots) == live_before + len(leaves)
    )
    c = tiny.config
    kv = 2 * c.num_hidden_layers * 2 * 48 * c.num_key_value_heads * c.head_dim * 4
    assert plan.kv_cache_bytes == kv


def test_allocations_are_fresh_zeros_from_one_traced_filler(tiny):
    plan = jaxlm.plan(tiny, max_batch=1, max_seq_len=8)
    scratch, _ = plan.prefill(plan.allocate(), np.ones((1, 4), np.int32))
    again = plan.allocate()
    for used, fresh in zip(jax.tree.leaves(scratch), jax.tree.leaves(again), strict=True):
        assert not np.asarray(fresh).any()
        assert fresh.unsafe_buffer_pointer() != used.unsafe_buffer_pointer()
    assert plan.layout._zeros._cache_size() == 1


def test_step_runs_in_place(tiny):
    plan = jaxlm.plan(tiny, max_batch=3, max_seq_len=32)
    prompt, lengths = left_padded(LENGTHS, tiny.config.vocab_size)
    scratch = plan.allocate()
    scratch, _ = plan.prefill(scratch, prompt, lengths)
    before = jax.tree.leaves(scratch)
    pointers = [x.unsafe_buffer_pointer() for x in before]
    for step in range(3):
        scratch, _ = plan.decode(scratch, prompt[:, step])
        after = jax.tree.leaves(scratch)
        assert all(x.is_deleted() for x in before)
        assert [x.unsafe_buffer_pointer() for x in after] == pointers
        before = after


@pytest.mark.parametrize("batch", [1, 3])
def test_xla_aliases_all_scratch_and_copies_no_cache(tiny, batch):
    seq = 40  # No dimension of the model's.
    plan = jaxlm.plan(tiny, max_batch=batch, max_seq_len=seq)
    for name, stats in plan.executables.items():
        assert stats.alias == plan.scratch_bytes, name
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plan.generator.params)
    step = plan.generator.decode_step.lower(
        abstract, plan.layout.abstract(), jax.ShapeDtypeStruct((batch,), jnp.int32)
    ).compile()
    assert step.memory_analysis().alias_size_in_bytes == plan.scratch_bytes
    c = tiny.config
    # A copy of a page array, or of the rows' keys or values whole, in either layout.
    n, d = batch * c.num_key_value_heads, c.head_dim
    pages = {s.shape for s in plan.layout.slots if s.name in ("k_pages", "v_pages")}
    cache_dims = ({n, d, seq}, {batch, c.num_key_value_heads, d, seq})
    for hlo in (step.as_text(), plan.compiled["decode"].as_text()):
        assert "input_output_alias" in hlo
        copies = re.findall(r"= \w+\[([\d,]+)\]\S* copy\(", hlo)
        shapes = [tuple(int(v) for v in dims.split(",")) for dims in copies]
        assert not [s for s in shapes if s in pages], copies
        assert not [s for s in shapes if any(cache <= set(s) for cache in cache_dims)], copies


def test_bfloat16_cache_is_stored_as_uint16_bits(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    model, _ = jaxlm.load(tmp_path, dtype=jnp.bfloat16)
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=16)
    caches = [s for s in plan.layout.slots if s.name == "k_pages"]
    assert {str(s.spec.dtype) for s in caches} == {"bfloat16"}
    assert {str(s.dtype) for s in caches} == {"uint16"}


def test_eight_billion_plan_without_allocating():
    config = ModelConfig.from_hf_config(LLAMA_31_8B)
    gc.collect()
    live_before = len(jax.live_arrays())
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.bfloat16))
    # The decode step alone, the one the bill is checked against: compiling 32 layers of
    # `generate` too took as long again.
    plan = jaxlm.plan(abstract, max_batch=8, max_seq_len=8192, steps=("decode",))
    gc.collect()
    assert len(jax.live_arrays()) == live_before
    kv = 2 * 32 * 8 * 8192 * 8 * 128 * 2
    assert plan.kv_cache_bytes == kv
    assert plan.weights_bytes == 8_030_261_248 * 2
    # XLA's arguments are the weights, the scratch, the stop strings with their token table
    # (`jaxlm.stops`), each row's `logit_bias` (ids and values) and the step's small inputs.
    decode = plan.executables["decode"]
    assert plan.weights_bytes + plan.scratch_bytes <= decode.argument
    inputs = decode.argument - plan.weights_bytes - plan.scratch_bytes
    bias = 8 * MAX_LOGIT_BIAS * (4 + 4)
    assert 0 <= inputs - stops.input_bytes(config.vocab_size) - bias < 4096
    assert plan.total_bytes >= plan.weights_bytes + plan.scratch_bytes


def test_budget_picks_the_largest_page_that_fits(tmp_path):
    make_hf_model(tmp_path, "llama_gqa4")
    from conftest import rewrite_config

    rewrite_config(tmp_path, max_position_embeddings=4096)
    model, _ = jaxlm.load(tmp_path)
    reference = jaxlm.plan(model, max_batch=2, max_seq_len=1280)
    budget = reference.total_bytes + 1000
    plan = jaxlm.plan(model, max_batch=2, budget=budget)
    assert plan.total_bytes <= budget
    assert plan.max_seq_len % 256 == 0
    assert plan.max_seq_len >= 1280
    bigger = jaxlm.plan(model, max_batch=2, max_seq_len=plan.max_seq_len + 256)
    assert bigger.total_bytes > budget
    with pytest.raises(
        PlanError, match=r"over the budget .* the largest that fits is `max_seq_len="
    ):
        jaxlm.plan(model, max_batch=2, max_seq_len=plan.max_seq_len + 256, budget=budget)
    # Below the weights nothing fits, which is known without compiling a step, with or
    # without a length asked for.
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    for seq in (None, 512):
        with jaxlm.CompileCounter() as compiles, pytest.raises(PlanError) as refused:
            jaxlm.plan(model, max_batch=2, max_seq_len=seq, budget=1000)
        assert compiles.builds == 0
        assert "no `max_seq_len` fits" in str(refused.value)
        assert f"weights {format_bytes(weights)}" in str(refused.value)


def test_parse_bytes():
    assert parse_bytes("1.5GiB") == 1.5 * 2**30
    assert parse_bytes("800MB") == 800_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("lots", "-1GiB", 0, "1.2.3GB", True):
        with pytest.raises(ValueError, match="`budget`"):
            parse_bytes(bad)


def test_report(tiny):
    plan = jaxlm.plan(tiny, max_batch=2, max_seq_len=32, budget="1GiB")
    text = str(plan)
    # Each row's 32 slots in one page of its own: [2 pages, 2 KV heads, head_dim 8, 32 slots].
    assert "model.layers.1.self_attn" in text and "k_pages" in text and "[2, 2, 8, 32]" in text
    assert "whole bill" in text and "temporaries" in text and "budget: 1.00 GiB" in text
    assert "<table>" in plan._repr_html_()
    import matplotlib

    matplotlib.use("Agg")
    ax = plan.plot()
    # One stacked bar: the weights, each slot, the rest of the peak; it ends at the whole bill.
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bill"]
    assert len(ax.patches) == 1 + len(plan.layout.slots) + 1
    widths = [p.get_width() for p in ax.patches]
    assert widths[0] == plan.weights_bytes / 2**20
    assert sum(widths) == pytest.approx(plan.total_bytes / 2**20, rel=1e-9)
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [plan.budget / 2**20]


# Bad input: each a clear error before any XLA work.


def test_prompt_longer_than_plan(tiny):
    # `prefill` and `decode` run the engine's own steps: the plan's compiled steps are not
    # called, so it compiles the decode loop alone.
    plan = jaxlm.plan(tiny, max_batch=1, max_seq_len=8, steps=("decode",))
    with pytest.raises(PlanError, match=r"prompt of 9 tokens exceeds .*`max_seq_len=8`"):
        plan.prefill(plan.allocate(), np.zeros((1, 9), np.int32))


def test_batch_larger_than_plan(tiny):
    plan = jaxlm.plan(tiny, max_batch=2, max_seq_len=8, steps=("decode",))
    with pytest.raises(PlanError, match=r"3 rows exceeds .*`max_batch=2`"):
        plan.prefill(plan.allocate(), np.zeros((3, 4), np.int32))


def test_scratch_of_another_plan(tiny):
    small = jaxlm.plan(tiny, max_batch=1, max_seq_len=8, steps=("decode",))
    big = jaxlm.plan(tiny, max_batch=1, max_seq_len=16, steps=("decode",))
    with pytest.raises(PlanError, match="does not belong to this plan"):
        big.prefill(small.allocate(), np.zeros((1, 4), np.int32))


def test_donated_scratch_reused(tiny):
    plan = jaxlm.plan(tiny, max_batch=1, max_seq_len=8, steps=("decode",))
    scratch = plan.allocate()
    plan.prefill(scratch, np.zeros((1, 4), np.int32))
    with pytest.raises(PlanError, match="donated to an earlier step"):
        plan.decode(scratch, [1])


def test_cache_full(tiny):
    plan = jaxlm.plan(tiny, max_batch=1, max_seq_len=4, steps=("decode",))
    scratch, _ = plan.prefill(plan.allocate(), np.zeros((1, 4), np.int32))
    with pytest.raises(PlanError, match="cache is full"):
        plan.decode(scratch, [1])


def test_plan_arguments():
    with pytest.raises(ValueError, match="`max_batch`"):
        jaxlm.plan(None, max_batch=0, max_seq_len=8)
    with pytest.raises(ValueError, match="give `max_seq_len`, `budget`"):
        jaxlm.plan(None, max_batch=1)


def test_release_host_memory_returns_free_heap_pages():
    from jaxlm.bench import current_rss
    from jaxlm.memory import release_host_memory

    # 256 MiB in 64 KiB blocks (below glibc's mmap threshold, so on the heap), each page
    # touched; one block in 16 stays, so the free pages lie between live blocks, where glibc
    # keeps them until `malloc_trim`.
    blocks = []
    for _ in range(4096):
        block = bytearray(1 << 16)
        block[::4096] = b"\1" * 16
        blocks.append(block)
    kept = blocks[::16]
    del blocks, block
    gc.collect()
    before = current_rss()
    assert release_host_memory()
    # The kernel's count of resident pages drops by most of the 240 MiB freed.
    assert before - current_rss() > 160 << 20
    del kept


def test_plan_measures_the_host_memory_of_its_compiled_steps(tmp_path):
    from jaxlm.memory import release_host_memory, resident_bytes

    def settled() -> int:
        gc.collect()
        release_host_memory()
        return resident_bytes()

    make_hf_model(tmp_path, "llama_gqa4")
    model, _ = jaxlm.load(tmp_path)
    # The first plan of a process also pays the compiler's one-time state; the second holds
    # only its executables.
    jaxlm.plan(model, max_batch=2, max_seq_len=64)
    plan = jaxlm.plan(model, max_batch=2, max_seq_len=64)
    held = plan.executables_host_bytes
    assert held > 1 << 20
    assert plan.resident_bytes == plan.total_bytes + held
    assert f"compiled steps (host memory): {format_bytes(held)}" in str(plan)
    before = settled()
    del plan
    # Dropping the plan frees its executables: the kernel's count of resident pages falls by
    # about what the plan measured.
    freed = before - settled()
    assert 0.5 * held < freed < 1.5 * held, (freed, held)


def test_bfloat16_decode_holds_no_float32_copy_of_the_weights(tmp_path):
    # With one column of activations, XLA:CPU computes a bf16 matmul in float32 and hoists the
    # conversion of every weight out of the decode loop: a float32 copy of the weights among
    # the temporaries. A float32 model's plan shows the temporaries without it.
    make_hf_model(tmp_path, "llama_gqa4")
    temps = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model, _ = jaxlm.load(tmp_path, dtype=dtype)
        plan = jaxlm.plan(model, max_batch=1, max_seq_len=32)
        temps[dtype] = {name: e.temp for name, e in plan.executables.items()}
        weights = jax.tree.leaves(nnx.state(model, nnx.Param))
        float32_weights = sum(4 * w.size for w in weights if w.ndim == 2)
    for name, temp in temps[jnp.bfloat16].items():
        assert temp < temps[jnp.float32][name] + float32_weights / 4, (name, temps)


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_embedding_rows_gather_without_a_copy_of_the_table(tied):
    # XLA:CPU gathers bf16 rows from a float32 copy of the whole table, hoisted out of the
    # decode loop. An untied table, stored as its bits, leaves no copy; a tied one, which the LM
    # head multiplies as floats, gathers through the native kernels and leaves none either. (A
    # bitcast of the whole table, as the tied one took before, is a copy among the temporaries
    # under XLA's default compile flags, but not under the suite's: the HLO shows it under both.)
    vocab, hidden = 8192, 64
    config = ModelConfig.from_hf_config(
        dict(BASE, model_type="llama", vocab_size=vocab, tie_word_embeddings=tied)
    )
    model = LlamaForCausalLM.abstract(config, dtype=jnp.bfloat16)
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=32)
    table = 2 * vocab * hidden
    whole = re.compile(rf"= \w+\[{vocab},{hidden}\]\S* (bitcast-convert|convert|copy)\(")
    for name, stats in plan.executables.items():
        # Beside the logits, the loop's rows hold a few arrays of the vocabulary's size (tokens
        # seen and counted, stop tokens): far from a copy of the table.
        assert stats.temp < table / 2, (name, stats.temp)
        assert not whole.search(plan.compiled[name].as_text()), name


def test_bfloat16_prefill_attends_without_converting_the_cache(tmp_path):
    # A chunk of several tokens multiplies the bf16 cache natively; a float32 product would
    # convert each layer's cache to float32 first.
    make_hf_model(tmp_path, "llama_gqa4")
    model, _ = jaxlm.load(tmp_path, dtype=jnp.bfloat16)
    # Its layout is all this takes of the plan.
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=32, steps=("decode",))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plan.generator.params)
    sds = jax.ShapeDtypeStruct
    hlo = (
        plan.generator.prefill_step.lower(
            abstract, plan.layout.abstract(), sds((1, 16), jnp.int32), sds((1,), jnp.int32)
        )
        .compile()
        .as_text()
    )
    c = model.config
    n, d = c.num_key_value_heads, c.head_dim
    assert "bf16" in hlo
    assert f"f32[{n},{d},32]" not in hlo and f"f32[{n},32,{d}]" not in hlo


def test_bfloat16_caches_are_not_copied_when_attention_reads_part_of_them(tmp_path):
    # Above 256 slots, attention picks the filled part of the cache in a conditional; bf16
    # caches (stored as uint16) read before it were copied twice per layer and step.
    make_hf_model(tmp_path, "llama_gqa4")
    model, _ = jaxlm.load(tmp_path, dtype=jnp.bfloat16)
    seq = 1024
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=seq, steps=("decode",))
    c = model.config
    n, d = c.num_key_value_heads, c.head_dim
    hlo = plan.compiled["decode"].as_text()
    assert "conditional(" in hlo
    shapes = (f"[{n},{seq},{d}]", f"[{n},{d},{seq}]")
    copies = [line for line in hlo.splitlines() if re.search(r"\bcopy\(", line)]
    assert not [line for line in copies if any(s in line for s in shapes)], copies


@settings(max_examples=300, deadline=None)
@given(
    weights=st.integers(0, 1000),
    per_page=st.integers(1, 50),
    temporaries=st.lists(st.integers(0, 80), min_size=1, max_size=40),
    limit=st.integers(0, 3000),
)
def test_fitting_a_budget_finds_the_most_pages_that_fit(weights, per_page, temporaries, limit):
    # Bills that grow with the pages, as XLA's temporaries may, against a search of every size.
    from jaxlm.budget import SEQ_STEP, fit

    extra = list(itertools.accumulate(temporaries))  # non-decreasing
    pages = len(extra)
    config = ModelConfig.from_hf_config(dict(BASE, model_type="llama"))
    config = dataclasses.replace(config, max_position_embeddings=pages * SEQ_STEP)

    def floor(seq):
        return weights + per_page * (seq // SEQ_STEP)

    def make(seq):
        return types.SimpleNamespace(seq=seq, total_bytes=floor(seq) + extra[seq // SEQ_STEP - 1])

    fitting = [n for n in range(1, pages + 1) if make(n * SEQ_STEP).total_bytes <= limit]
    best = fit(make, floor, limit, config)
    assert (best and best.seq) == (max(fitting) * SEQ_STEP if fitting else None)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=64, max_size=64),
    st.integers(0, 5000),
    st.integers(0, 2000),
    st.sets(st.integers(1, 64), max_size=4),
)
def test_budget_search_finds_what_trying_every_length_finds(growth, limit, base, known):
    # Any bill that never shrinks as the pages grow: weights and scratch of 10 a page, and
    # temporaries growing by steps drawn at random (flat, linear or neither).
    from jaxlm.budget import SEQ_STEP, fit

    temporaries = list(itertools.accumulate(growth, initial=base))
    floor = lambda seq: 10 * (seq // SEQ_STEP)
    compiled = []

    def make(seq):
        compiled.append(seq)
        return types.SimpleNamespace(total_bytes=floor(seq) + temporaries[seq // SEQ_STEP], seq=seq)

    config = types.SimpleNamespace(max_position_embeddings=64 * SEQ_STEP)
    fitted = fit(make, floor, limit, config)
    fits = [p for p in range(1, 65) if floor(p * SEQ_STEP) + temporaries[p] <= limit]
    assert (fitted and fitted.seq) == (max(fits) * SEQ_STEP if fits else None)
    # Three guesses, then a bisection of what is left.
    assert len(compiled) <= 1 + 3 + 6
    # Bills of plans built before (a plan of the same sizes, a budget before) lead to the same
    # plan, with no more compilations.
    bills = [(p, floor(p * SEQ_STEP) + temporaries[p]) for p in known]
    compiled.clear()
    again = fit(make, floor, limit, config, bills)
    assert (again and again.seq) == (fitted and fitted.seq)
    assert len(compiled) <= 1 + 3 + 6
