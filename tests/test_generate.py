"""generate / stream / chat: greedy equals a reference loop, sampling, buckets, stops, errors."""

from __future__ import annotations

import gc
import re
import weakref

import jax
import numpy as np
import pytest
import transformers
from conftest import CHATML, make_hf_model

import jaxlm
from jaxlm import kernels
from jaxlm.outputs import Detokenizer, Progress, cut_at_stop
from jaxlm.plans import KEPT_PLANS, request_plan

PROMPTS = [[5, 17, 33, 2, 9], [40, 41], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@pytest.fixture(scope="module")
def chat_model(tiny_chat):
    return jaxlm.load(tiny_chat)


def reference_greedy(model, prompt, n, stop=()):
    """Argmax of the full forward over the growing sequence, one token at a time.

    The sequence is right-padded to a fixed length so one compiled forward serves every step;
    causal attention makes the padding invisible to the real positions.
    """
    width = max(32, len(prompt) + n)
    forward = jax.jit(lambda ids, mask: model(ids, attention_mask=mask))
    seq = list(prompt)
    for _ in range(n):
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(seq)] = seq
        mask = np.arange(width)[None] < len(seq)
        token = int(np.asarray(forward(ids, mask))[0, len(seq) - 1].argmax())
        if token in stop:
            break
        seq.append(token)
    return seq[len(prompt) :]


@pytest.mark.parametrize("family", ["llama_gqa4", "qwen3", "mistral_window"])
def test_greedy_equals_reference_loop(tmp_path, family):
    make_hf_model(tmp_path, family)
    model, _ = jaxlm.load(tmp_path)
    out = jaxlm.generate(model, None, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert [o.finish_reason for o in out] == ["length"] * 3
    for prompt, got in zip(PROMPTS, out, strict=True):
        assert got.token_ids == reference_greedy(model, prompt, 12)
        assert got.prompt_token_ids == prompt


def test_greedy_stops_at_stop_tokens(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    free = jaxlm.generate(model, None, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    stop = free[0].token_ids[4]
    out = jaxlm.generate(model, None, PROMPTS, max_new_tokens=12, stop_token_ids=[stop])
    for prompt, got in zip(PROMPTS, out, strict=True):
        expected = reference_greedy(model, prompt, 12, stop=(stop,))
        assert got.token_ids == expected
        assert got.finish_reason == ("stop" if len(expected) < 12 else "length")
    assert out[0].token_ids == free[0].token_ids[: free[0].token_ids.index(stop)]


def slots_scored(hlo: str) -> set[int]:
    """The numbers of slots that the attention scores in `hlo` span: float32 products and
    fusions `[rows, pages, kv_heads, queries, page_size]` (`jaxlm.ops.attend`: pages times
    their size), and `[.., .., slots]` where XLA dropped the unit dimensions of one page."""
    shapes = re.findall(r"= f32\[([\d,]+)\]\S* (?:fusion|dot)\(", hlo)
    dims = [[int(n) for n in shape.split(",")] for shape in shapes]
    return {d[1] * d[4] for d in dims if len(d) == 5} | {d[2] for d in dims if len(d) == 3}


@pytest.mark.parametrize("native", ["0", "1"], ids=["xla", "native"])
def test_attention_reads_the_filled_part_of_a_large_cache(tiny_llama, monkeypatch, native):
    # XLA's attention, as it runs off one CPU device, scores the filled part of the cache; the
    # native kernel skips the pages no query sees (`tests/test_kernels.py`).
    monkeypatch.setenv(kernels.SWITCH, native)
    model, _ = jaxlm.load(tiny_llama[0])
    plan = jaxlm.plan(model, max_batch=2, max_seq_len=1024, prefill_chunk=10)
    if native == "0":
        # Scores against the first 256, 512 or all 1024 slots, chosen at run time, and a chunk
        # that starts the cache against its own 10 slots.
        hlo = plan.compiled["generate"].as_text()
        for size in (10, 256, 512, 1024):
            assert size in slots_scored(hlo), size
    # The long prompt fills 250 slots and decodes across the first size into the second.
    long = [int(t) for t in np.random.default_rng(0).integers(1, 96, 250)]
    prompts = [long, PROMPTS[1]]
    out = jaxlm.generate(model, None, prompts, max_new_tokens=12, stop_token_ids=[], plan=plan)
    for prompt, got in zip(prompts, out, strict=True):
        assert got.token_ids == reference_greedy(model, prompt, 12)


def test_given_plan_and_prefill_chunks(tiny_llama, monkeypatch):
    # XLA's attention, whose scores show in the optimized HLO (the native kernel's do not).
    monkeypatch.setenv(kernels.SWITCH, "0")
    model, _ = jaxlm.load(tiny_llama[0])
    plan = jaxlm.plan(model, max_batch=4, max_seq_len=40, prefill_chunk=4)
    # The first chunk attends over its own 4 slots, the later ones over all 40.
    hlo = plan.compiled["generate"].as_text()
    for size in (4, 40):
        assert size in slots_scored(hlo), size
    out = jaxlm.generate(model, None, PROMPTS, max_new_tokens=9, stop_token_ids=[], plan=plan)
    for prompt, got in zip(PROMPTS, out, strict=True):
        assert got.token_ids == reference_greedy(model, prompt, 9)


def test_same_seed_same_tokens_and_greedy_rows_stay_greedy(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    kw = dict(max_new_tokens=10, stop_token_ids=[], top_k=20)
    params = jaxlm.SamplingParams(temperature=[0.0, 1.0, 1.5], seed=3, **kw)
    a = [o.token_ids for o in jaxlm.generate(model, None, PROMPTS, params)]
    b = [o.token_ids for o in jaxlm.generate(model, None, PROMPTS, params)]
    c = [o.token_ids for o in jaxlm.generate(model, None, PROMPTS, params, seed=4)]
    assert a == b
    assert a[1:] != c[1:]
    assert a[0] == reference_greedy(model, PROMPTS[0], 10)
    # A row's samples depend on its seed and position in the batch, not on the other rows.
    alone = jaxlm.generate(model, None, PROMPTS[:2], temperature=[0.5, 1.0], seed=3, **kw)
    assert alone[1].token_ids == a[1]


def test_sampling_changes_compile_nothing(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    jaxlm.generate(model, None, [[1, 2, 3]], max_new_tokens=5)
    with jaxlm.CompileCounter() as compiles:
        for i, prompt in enumerate([[4, 5], [6] * 9, list(range(1, 17))]):
            jaxlm.generate(
                model,
                None,
                prompt,
                max_new_tokens=3 + 4 * i,
                temperature=0.3 * i,
                top_p=1.0 - 0.1 * i,
                top_k=i,
                min_p=0.01 * i,
                repetition_penalty=1.0 + 0.1 * i,
                seed=i,
            )
    assert compiles.builds == 0


def test_one_dispatch_per_generate_and_a_while_loop(tiny_llama, monkeypatch):
    model, _ = jaxlm.load(tiny_llama[0])
    jaxlm.generate(model, None, PROMPTS, max_new_tokens=6)
    generator = jaxlm.generator.generator_of(model)
    plan = generator.plans[(4, 16, 32, ("generate",), 0)]
    assert list(plan.compiled) == ["generate"]
    assert " while(" in plan.compiled["generate"].as_text()
    calls = []

    def counter(fn, name):
        def counted(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return counted

    for name in ("prefill_step", "decode_step"):
        monkeypatch.setattr(generator, name, counter(getattr(generator, name), f"generator.{name}"))
    for name, step in generator.steps.items():
        monkeypatch.setitem(generator.steps, name, counter(step, f"generator.steps[{name!r}]"))
    monkeypatch.setitem(plan.compiled, "generate", counter(plan.compiled["generate"], "plan"))
    jaxlm.generate(model, None, PROMPTS, max_new_tokens=6, temperature=0.7)
    # One call, to the executable the plan compiled and accounted for.
    assert calls == ["plan"]


def test_repetition_penalty_avoids_repeats(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    kw = dict(max_new_tokens=24, stop_token_ids=[])
    plain = jaxlm.generate(model, None, PROMPTS[0], **kw)[0].token_ids
    penalized = jaxlm.generate(model, None, PROMPTS[0], repetition_penalty=1e6, **kw)[0].token_ids
    assert len(set(plain)) < len(plain)
    # With a huge penalty every seen token (prompt included) loses to any unseen one.
    seen = set(PROMPTS[0])
    for t in penalized:
        assert t not in seen
        seen.add(t)


def test_text_prompts_stop_strings_and_eos(chat_model):
    model, tok = chat_model
    free = jaxlm.generate(model, tok, "The capital of", max_new_tokens=20, stop_token_ids=[])
    assert len(free) == 1
    text = free[0].text
    assert text == tok.decode(free[0].token_ids)
    assert free[0].prompt_token_ids == tok.encode("The capital of")
    stop = text[5:8]
    first = text.find(stop)
    out = jaxlm.generate(
        model, tok, "The capital of", max_new_tokens=20, stop_token_ids=[], stop=stop
    )
    assert out[0].text == text[:first]
    assert [o.finish_reason for o in out] == ["stop"]
    assert tok.decode(out[0].token_ids) == text[: len(tok.decode(out[0].token_ids))]
    assert len(tok.decode(out[0].token_ids)) <= first
    # EOS comes from the tokenizer config by default.
    assert tok.eos_token_ids == (tok.backend.token_to_id("<|im_end|>"), 0)


def test_stream_yields_the_generated_text(chat_model):
    model, tok = chat_model
    kw = dict(max_new_tokens=30, temperature=0.9, seed=7, stop_token_ids=[])
    (out,) = jaxlm.generate(model, tok, "Once upon a time", **kw)
    full = out.text
    pieces = list(jaxlm.stream(model, tok, "Once upon a time", chunk_tokens=3, **kw))
    assert "".join(d.text for d in pieces) == full
    assert len([d for d in pieces if d.text]) > 1
    # The deltas' tokens are generate's, and the last one says why it ended.
    assert [t for d in pieces for t in d.token_ids] == out.token_ids
    assert pieces[-1].finish_reason == out.finish_reason == "length"
    assert all(d.finish_reason is None for d in pieces[:-1])
    batch = list(jaxlm.stream(model, tok, ["Once upon a time", "café"], **kw))
    assert all(len(p) == 2 for p in batch)
    assert "".join(p[0].text for p in batch) == full
    assert [t for p in batch for t in p[0].token_ids] == out.token_ids
    stop = full[4:6]
    cut = list(jaxlm.stream(model, tok, "Once upon a time", stop=stop, **kw))
    assert "".join(d.text for d in cut) == full[: full.find(stop)]
    assert cut[-1].finish_reason == "stop"


def test_stream_plan_accounts_for_every_step_it_runs(chat_model):
    model, tok = chat_model
    prompt = tok.encode("Once upon a time")
    plan = request_plan(model, 1, len(prompt), 9, streaming=True)
    assert set(plan.executables) == {"start", "decode"}
    plan.keep(plan.allocate())
    # The stream runs the very executables its plan compiled and measured: nothing compiles.
    with jaxlm.CompileCounter() as compiles:
        pieces = list(jaxlm.stream(model, tok, prompt, max_new_tokens=9, chunk_tokens=4))
    assert compiles.builds == 0
    assert len([d for d in pieces if d.text]) > 1


def test_detokenizer_holds_back_partial_characters(chat_model):
    _, tok = chat_model
    ids = tok.encode("café 東京 😀 done")
    detok = Detokenizer(tok, stop=("done",))
    pieces = [detok.update(ids[: i + 1], final=False) for i in range(len(ids))]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "café 東京 😀 "
    assert detok.finished


class Pieces:
    """A tokenizer whose token `i` is `PIECES[i]`."""

    PIECES = ("a", "xc", "e", "b", "c")

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids)


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [0, 1, 3, 4, 2], [1, 1, 3]])
def test_a_delta_hands_out_a_token_with_the_last_of_its_text(ids):
    # Token 1 ("xc") ends in the first character of the stop string "ce": its "c" is held back,
    # and the token with it, until the next token shows whether the stop string cuts it.
    tok = Pieces()
    progress = Progress(tok, ("ce",), [0])
    deltas = [progress.update(ids[: i + 1], i + 1 == len(ids), "length") for i in range(len(ids))]
    deltas = [d for d in deltas if d is not None]
    text, kept, cut = cut_at_stop(tok, ids, ("ce",))
    result = progress.result
    assert (result.text, result.token_ids) == (text, kept)
    assert result.finish_reason == ("stop" if cut else "length") == deltas[-1].finish_reason
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == kept
    sent, released = [], ""
    for d in deltas:
        sent += d.token_ids
        released += d.text
        # Every token handed out has all of its text out.
        assert released.startswith(tok.decode(sent))


class CountingPieces(Pieces):
    """`Pieces`, counting the ids it decodes."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


def test_a_held_token_costs_the_last_updates_not_the_whole_output():
    # Each update adds "a" and "xc", whose "c" may begin the stop string "ce": held back, with
    # its token, until the next update. Which tokens have all their text out is found among
    # the last updates' tokens, not by decoding the whole output again at every update.
    tok = CountingPieces()
    progress = Progress(tok, ("ce",), [0])
    ids, decoded = [], []
    for _ in range(1000):
        ids += [0, 1]
        before = tok.decoded
        delta = progress.update(list(ids), False, "length")
        decoded.append(tok.decoded - before)
        assert delta.text == ("ax" if len(ids) == 2 else "cax")
        assert delta.token_ids == ([0] if len(ids) == 2 else [1, 0])
    # The same few ids an update at 2,000 tokens as at 20 (not the thousands of a whole decode).
    assert max(decoded[-100:]) == max(decoded[10:20]) <= 32, decoded[-100:]


def test_chat_renders_the_template_as_transformers_does(chat_model, tiny_chat):
    model, tok = chat_model
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! Ünïcödé?"},
    ]
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_chat)
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert tok.chat_template == CHATML
    reply = jaxlm.chat(model, tok, messages, max_new_tokens=8)
    prompt = tok.encode(expected, add_special_tokens=False)
    assert reply == jaxlm.generate(model, tok, prompt, max_new_tokens=8)[0].text
    assert "".join(jaxlm.chat(model, tok, messages, max_new_tokens=8, stream=True)) == reply


def test_repeated_generate_keeps_live_arrays_constant(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    jaxlm.generate(model, None, PROMPTS, max_new_tokens=5)
    before = len(jax.live_arrays()), sum(x.nbytes for x in jax.live_arrays())
    for i in range(5):
        jaxlm.generate(model, None, PROMPTS, max_new_tokens=5 + i, temperature=0.1 * i)
    after = len(jax.live_arrays()), sum(x.nbytes for x in jax.live_arrays())
    assert after == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[[]]), "prompt 0 is empty"),
        (dict(prompts=""), "prompt 0 is empty"),
        (dict(prompts=[]), "`prompts` is empty"),
        (dict(max_new_tokens=0), "`max_new_tokens` must be an integer >= 1"),
        (dict(max_new_tokens=2.5), "`max_new_tokens`"),
        (dict(top_p=0.0), r"`top_p` must be in \(0, 1\]"),
        (dict(top_p=1.5), r"`top_p` must be in \(0, 1\]"),
        (dict(temperature=-1.0), "`temperature` must be a finite number >= 0"),
        (dict(temperature=float("nan")), "`temperature`"),
        (dict(top_k=-3), "`top_k`"),
        (dict(min_p=2.0), "`min_p`"),
        (dict(repetition_penalty=0.0), "`repetition_penalty`"),
        (dict(temperature=[0.5]), "`temperature` has 1 values for 3 prompts"),
        (dict(prompts=[[1, 2, 10_000]]), "outside the vocabulary"),
        (dict(prompts=["text"]), "need a tokenizer"),
        (dict(stop_token_ids=[-1]), "`stop_token_ids`"),
    ],
)
def test_bad_requests(tiny_llama, kwargs, match):
    model, _ = jaxlm.load(tiny_llama[0])
    args = dict(prompts=PROMPTS, max_new_tokens=4) | kwargs
    with jaxlm.CompileCounter() as compiles, pytest.raises(ValueError, match=match):
        jaxlm.generate(model, None, args.pop("prompts"), **args)
    assert compiles.builds == 0


def test_prompt_longer_than_the_plan(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    plan = jaxlm.plan(model, max_batch=1, max_seq_len=16)
    with pytest.raises(jaxlm.PlanError, match=r"`max_new_tokens=8` exceeds .*`max_seq_len=16`"):
        jaxlm.generate(model, None, list(range(1, 12)), max_new_tokens=8, plan=plan)
    with pytest.raises(jaxlm.PlanError, match=r"2 prompts exceed the plan's `max_batch=1`"):
        jaxlm.generate(model, None, PROMPTS[:2], max_new_tokens=2, plan=plan)


def test_generate_runs_weights_quantized_in_place(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    kw = dict(max_new_tokens=8, stop_token_ids=[])
    jaxlm.generate(model, None, PROMPTS, **kw)
    floats = weakref.ref(model.model.layers[0].mlp.gate_up_proj.weight.get_value())
    jaxlm.quantize(model, "int8")
    got = [o.token_ids for o in jaxlm.generate(model, None, PROMPTS, **kw)]
    loaded, _ = jaxlm.load(tiny_llama[0], quantize="int8")
    assert got == [o.token_ids for o in jaxlm.generate(loaded, None, PROMPTS, **kw)]
    # Nothing keeps the float weights: the steps and plans made for them went with them.
    gc.collect()
    assert floats() is None


def test_plans_kept_are_bounded_and_only_the_last_holds_scratch(tiny_llama):
    model, _ = jaxlm.load(tiny_llama[0])
    gc.collect()
    before = sum(x.nbytes for x in jax.live_arrays())
    rng = np.random.default_rng(0)
    # Six shapes of six buckets (rows, prompt and cache lengths), up to the model's context.
    shapes = [(1, 10), (8, 120), (2, 40), (8, 20), (4, 70), (1, 100)]
    for i in rng.permutation(len(shapes)):
        rows, length = shapes[i]
        prompts = rng.integers(0, 90, (rows, length)).tolist()
        jaxlm.generate(model, None, prompts, max_new_tokens=4, stop_token_ids=[])
    plans = jaxlm.plans_of(model)
    assert len(plans) == KEPT_PLANS == 4
    assert [p.pooled for p in plans] == [True, False, False, False]
    # Beside the weights, what stays live is the scratch of one plan, at most the largest's.
    gc.collect()
    live = sum(x.nbytes for x in jax.live_arrays()) - before
    largest = jaxlm.plan(model, max_batch=8, max_seq_len=128 + 16)
    assert live == plans[0].scratch_bytes <= largest.scratch_bytes
    assert "holds its scratch" in repr(plans).splitlines()[1]
    plans.clear()
    gc.collect()
    assert len(plans) == 0 and sum(x.nbytes for x in jax.live_arrays()) == before


def test_the_loop_ends_at_a_stop_string(chat_model):
    model, tok = chat_model
    kw = dict(max_new_tokens=64, stop_token_ids=[])
    prompt = "Once upon a time"
    out = jaxlm.generate(model, tok, prompt, **kw)[0].token_ids
    # A stop string of two tokens of whole characters, from the fourth token on.
    stop = next(
        text for k in range(3, 60) if (text := tok.decode(out[k : k + 2])).isascii() and text
    )
    # The tokens the loop samples before the text holds the stop string, by the tokenizer.
    until = next(k for k in range(1, len(out) + 1) if stop in tok.decode(out[:k]))
    jaxlm.plans_of(model).clear()
    result = jaxlm.generate(model, tok, prompt, stop=stop, **kw)
    text = tok.decode(out)
    assert result[0].text == text[: text.index(stop)]
    assert [o.finish_reason for o in result] == ["stop"]
    scratch = jaxlm.plans_of(model)[0]._pool[0]
    assert until < 64 and int(scratch["decode"]["sampled"][0]) == until


def test_token_bytes_are_what_the_tokenizer_decodes(chat_model):
    # Against the tokenizer's own decoding, on random ids whose bytes are whole characters.
    from jaxlm.stops import TOKEN_BYTES, token_table

    for tok in (chat_model[1], jaxlm.load(progress=False)[1]):
        table, lengths = token_table(tok, tok.vocab_size)
        rng = np.random.default_rng(0)
        checked = 0
        for _ in range(1000):
            ids = rng.integers(0, tok.vocab_size, 3).tolist()
            if max(lengths[ids]) > TOKEN_BYTES:
                continue
            data = b"".join(bytes(table[i, : lengths[i]]) for i in ids)
            try:
                text = data.decode()
            except UnicodeDecodeError:
                continue
            assert text == tok.decode(ids), ids
            checked += 1
        assert checked > 100


def test_a_bad_response_format_is_refused_before_any_work(chat_model):
    model, tok = chat_model
    with pytest.raises(ValueError, match="`response_format` must be an object"):
        jaxlm.generate(model, tok, "Hi", max_new_tokens=4, response_format="json")
    with pytest.raises(ValueError, match=r"`response_format\.type` must be"):
        list(jaxlm.stream(model, tok, "Hi", max_new_tokens=4, response_format={"type": "xml"}))
    with pytest.raises(ValueError, match=r"`response_format` (is not supported|does not compile)"):
        schema = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
        jaxlm.generate(model, tok, "Hi", max_new_tokens=4, response_format=schema)
