"""Reliability: threads, interrupted streams, long sessions, hostile files and hostile requests.

Donation makes every call consume its scratch, so these tests check what must survive it:
concurrent requests never share scratch, an interrupted stream leaves the model usable, a long
session neither leaks arrays nor compiles, and hostile files and requests raise one clear error
(`LoadError`, `ValueError`) before any XLA work, never a NumPy traceback, a crash or a hang.
"""

from __future__ import annotations

import collections
import gc
import json
import math
import random
import shutil
import struct
import threading
import time

import gguf
import jax
import jax.monitoring
import numpy as np
import pytest
import torch
from conftest import make_hf_model
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import jaxlm
from jaxlm.config import ModelConfig
from jaxlm.errors import LoadError
from jaxlm.loading import checkpoint_tensors, open_checkpoint
from jaxlm.outputs import Detokenizer
from jaxlm.plans import MIN_NEW_TOKENS_BUCKET, MIN_PROMPT_BUCKET, bucket

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Prompt lengths of the two prompt buckets the shared model serves (16 and 32 tokens); with at
# most 16 new tokens, each bucket is one plan.
SHORT, LONG = (3, 7, 12, 16), (17, 23, 32)


def weights(model) -> dict[str, np.ndarray]:
    """The model's tensors by checkpoint name, as NumPy arrays."""
    return checkpoint_tensors(model)


def differing(a: np.ndarray, b: np.ndarray) -> int:
    """How many elements differ, NaN equal to NaN."""
    return int(np.sum(~((a == b) | (np.isnan(a) & np.isnan(b)))))


class CompiledNames:
    """The names of the functions XLA compiles while active, read from JAX's events."""

    def __init__(self):
        self.names: list[str] = []

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.names.append(str(kwargs.get("fun_name")))

    def __enter__(self) -> CompiledNames:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


class Chat:
    """The shared tiny chat model and the outputs of a fresh load, before anything else ran."""

    def __init__(self, path):
        self.model, self.tok = jaxlm.load(path, progress=False)
        self.vocab = self.model.config.vocab_size
        rng = random.Random(0)
        self.requests = [
            ([rng.randrange(3, self.vocab) for _ in range(n)], new)
            for n, new in [(5, 12), (20, 16), (9, 7), (32, 10)]
        ]
        self.fresh = [self.generate(ids, new) for ids, new in self.requests]
        self.fresh_text = [self.stream(ids, new) for ids, new in self.requests]

    def generate(self, ids, new, **kw):
        return jaxlm.generate(self.model, self.tok, ids, max_new_tokens=new, **kw)[0].token_ids

    def deltas(self, ids, new, **kw):
        return list(jaxlm.stream(self.model, self.tok, ids, max_new_tokens=new, **kw))

    def stream(self, ids, new, **kw):
        return "".join(d.text for d in self.deltas(ids, new, **kw))

    def check_fresh(self):
        """The model gives the tokens and text it gave when fresh."""
        for (ids, new), tokens, text in zip(
            self.requests, self.fresh, self.fresh_text, strict=True
        ):
            assert self.generate(ids, new) == tokens
            deltas = self.deltas(ids, new)
            assert "".join(d.text for d in deltas) == text
            assert [t for d in deltas for t in d.token_ids] == tokens

    def pools(self):
        return [plan._pool for plan in jaxlm.generator.generator_of(self.model).plans.values()]


@pytest.fixture(scope="module")
def chat(tiny_chat):
    return Chat(tiny_chat)


def live(chat=None) -> tuple[int, int]:
    """The number and bytes of live device buffers, without the plans' idle scratch if `chat`.

    Buffers, not arrays: JAX keeps a varying few extra array objects that alias scratch buffers
    (the 0-d `index`, which the decode loop returns unchanged); they hold no memory.
    """
    gc.collect()
    arrays = jax.live_arrays()
    pooled = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(chat.pools())} if chat else set()
    buffers = {x.unsafe_buffer_pointer(): x.nbytes for x in arrays}
    outside = {k: v for k, v in buffers.items() if k not in pooled}
    return len(outside), sum(outside.values())


# Long sessions.


def test_200_calls_keep_live_arrays_and_compile_nothing(tiny_chat, record_property):
    """200 requests of two prompt buckets and varied sampling, after one warm-up request per
    bucket, leave the live buffers as they were and compile nothing; the warm-up compiles at
    most one generation executable per bucket (none if this process compiled them already)."""
    model, tok = jaxlm.load(tiny_chat, progress=False)
    vocab = model.config.vocab_size
    rng = random.Random(2)

    def request(i):
        n = rng.choice(SHORT + LONG)
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        sampling = dict(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
            top_k=rng.choice([None, 1, 10, vocab + 5]),
            top_p=rng.choice([None, 0.9, 0.5]),
            min_p=rng.choice([None, 0.05]),
            repetition_penalty=rng.choice([None, 1.3]),
            seed=i,
        )
        return ids, rng.randint(1, 16), sampling

    requests = [request(i) for i in range(200)]
    buckets = {
        (bucket(len(ids), MIN_PROMPT_BUCKET), bucket(new, MIN_NEW_TOKENS_BUCKET))
        for ids, new, _ in requests
    }
    with jaxlm.CompileCounter() as warmup, CompiledNames() as warmup_names:
        for n in (SHORT[0], LONG[0]):
            jaxlm.generate(model, tok, list(range(3, 3 + n)), max_new_tokens=16)
    before, arrays_before = live(), len(jax.live_arrays())
    with jaxlm.CompileCounter() as compiles:
        for ids, new, sampling in requests:
            out = jaxlm.generate(model, tok, ids, max_new_tokens=new, **sampling)[0].token_ids
            assert len(out) <= new and all(0 <= t < vocab for t in out)
        # The plan used last holds its scratch between calls (`jaxlm.plans_of`): end on the
        # warm-up's last bucket, as before.
        jaxlm.generate(model, tok, list(range(3, 3 + LONG[0])), max_new_tokens=16)
    after, arrays_after = live(), len(jax.live_arrays())
    generation = [n for n in warmup_names.names if "_generate" in n]
    figures = dict(
        buffers_before=before,
        buffers_after=after,
        arrays_before=arrays_before,
        arrays_after=arrays_after,
        compiles_warmup=warmup.count,
        warmup_functions=dict(collections.Counter(warmup_names.names)),
        compiles_soak=compiles.builds,
        generate_executables=len(generation),
        buckets=len(buckets),
    )
    record_property("soak", figures)
    print("\nsoak:", figures)
    assert after == before
    assert compiles.builds == 0
    assert len(generation) <= len(buckets)


# Threads.


def test_threads_give_the_tokens_of_requests_run_one_at_a_time(chat):
    rng = random.Random(1)
    requests = []
    for thread in range(4):
        for i in range(10):
            n = rng.choice(SHORT + LONG)
            ids = [rng.randrange(3, chat.vocab) for _ in range(n)]
            requests.append((thread, ids, rng.choice([4, 9, 16]), i % 3 == 0))

    def run(ids, new, streamed):
        return chat.stream(ids, new) if streamed else chat.generate(ids, new)

    expected = [run(ids, new, s) for _, ids, new, s in requests]
    got: dict[int, object] = {}
    errors = []
    start = threading.Barrier(4)

    def worker(thread):
        start.wait()
        try:
            for k, (t, ids, new, s) in enumerate(requests):
                if t == thread:
                    got[k] = run(ids, new, s)
        except BaseException as e:
            errors.append(e)

    for _ in range(2):
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert [got[k] for k in range(len(requests))] == expected
    # Each request returned its scratch: a plan's pool holds at most one per thread, none freed.
    for pool in chat.pools():
        assert len(pool) <= 4
        assert not any(x.is_deleted() for x in jax.tree.leaves(pool))


# Interrupted and failed streams.


class StopError(Exception):
    pass


def consume(chat, how: str):
    ids, new = chat.requests[1]
    it = jaxlm.stream(chat.model, chat.tok, ids, max_new_tokens=new, chunk_tokens=2)
    if how == "finish":
        assert "".join(d.text for d in it) == chat.fresh_text[1]
    elif how == "close":
        next(it)
        it.close()
    elif how == "abandon":
        next(it)
        del it
        gc.collect()
    else:
        error = StopError if how == "raise" else KeyboardInterrupt
        with pytest.raises(error):
            for i, _ in enumerate(it):
                if i == 1:
                    raise error()


@pytest.mark.parametrize("how", ["raise", "close", "abandon", "keyboard_interrupt"])
def test_interrupted_streams_leave_the_model_as_fresh(chat, how):
    chat.check_fresh()
    consume(chat, "finish")
    before = live(chat)
    consume(chat, how)
    chat.check_fresh()
    consume(chat, "finish")
    assert live(chat) == before
    for pool in chat.pools():
        assert not any(x.is_deleted() for x in jax.tree.leaves(pool))


def test_interrupt_during_the_call_loses_only_that_scratch(chat, monkeypatch):
    """Ctrl-C lands once the jitted call returns: its scratch is dropped, not half-returned."""
    chat.check_fresh()
    real = jaxlm.Plan.step

    def step(plan, *args, **kwargs):
        run = real(plan, *args, **kwargs)

        def interrupted(*args, **kwargs):
            run(*args, **kwargs)
            raise KeyboardInterrupt

        return interrupted

    monkeypatch.setattr(jaxlm.Plan, "step", step)
    for ids, new in chat.requests:
        with pytest.raises(KeyboardInterrupt):
            chat.generate(ids, new)
    monkeypatch.undo()
    chat.check_fresh()


# Hostile files: safetensors.


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile_hf")
    make_hf_model(path, "llama_gqa4")
    model, _ = jaxlm.load(path, progress=False)
    return path, weights(model)


def safetensors_layout(data: bytes) -> tuple[int, dict[str, tuple[int, int]]]:
    """(where the tensor data starts, each tensor's byte range in the file)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    start = 8 + n
    return start, {
        name: (start + info["data_offsets"][0], start + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }


def mutated_copy(source, target, file: str, data: bytes):
    target.mkdir()
    for f in source.iterdir():
        if f.name != file:
            shutil.copy(f, target / f.name)
    (target / file).write_bytes(data)


def test_hostile_safetensors(hf_dir, tmp_path, record_property):
    """A truncated file, or one with a bit flipped, loads or raises `LoadError` naming it.

    Exactly: a truncated file always raises `LoadError`. A flip in the header (its length or its
    JSON) raises `LoadError` or loads weights identical to the original. A flip in the tensor
    data raises `LoadError` (a NaN or infinity found by `check_finite`) or loads weights of which
    only the tensor holding the flipped byte differs, in at most one element, with its shape.
    The message names the model directory or the file in it.
    """
    source, original = hf_dir
    data = (source / "model.safetensors").read_bytes()
    start, ranges = safetensors_layout(data)
    tally = collections.Counter()

    @FUZZ
    @given(st.sampled_from(["header", "data", "truncate"]), st.data())
    def check(region, draw):
        k = tally["tried"]
        tally["tried"] += 1
        target = tmp_path / f"m{k}"
        if region == "truncate":
            mutated = data[: draw.draw(st.integers(0, len(data) - 1))]
        else:
            low, high = (0, start) if region == "header" else (start, len(data))
            at = draw.draw(st.integers(low, high - 1))
            mutated = bytearray(data)
            mutated[at] ^= 1 << draw.draw(st.integers(0, 7))
        mutated_copy(source, target, "model.safetensors", bytes(mutated))
        try:
            model, _ = jaxlm.load(target, progress=False)
        except LoadError as e:
            assert str(target) in str(e)
            tally["clear error"] += 1
            return
        assert region != "truncate", "a truncated file loaded"
        got = weights(model)
        assert got.keys() == original.keys()
        flipped = [n for n, (lo, hi) in ranges.items() if region == "data" and lo <= at < hi]
        for name, value in got.items():
            assert value.shape == original[name].shape
            allowed = 1 if name in flipped else 0
            assert differing(value, original[name]) <= allowed, name
        tally["loaded"] += 1

    check()
    record_property("hostile_safetensors", dict(tally))
    print("\nhostile safetensors:", dict(tally))
    assert tally["clear error"] > 0


# Hostile files: GGUF.

GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
}


def write_tiny_gguf(path, metadata=None, shapes=None):
    """A one-layer llama GGUF with F32, F16 and Q8_0 tensors and a SentencePiece tokenizer."""
    rng = np.random.default_rng(0)
    h, i, v = 32, 64, 48
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(i)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(v)
    tokens = ["<unk>", "<s>", "</s>", "▁"] + [chr(c) for c in range(97, 123)]
    tokens += ["▁" + chr(c) for c in range(97, 97 + v - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [1] * (v - 3))
    writer.add_token_scores([-float(k) for k in range(v)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if metadata is not None:
        metadata(writer)
    kinds = {"output.weight": Q.F16, "blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.F16}
    kinds["blk.0.ffn_gate.weight"] = Q.Q8_0
    default = {
        "token_embd.weight": (v, h),
        "output.weight": (v, h),
        "output_norm.weight": (h,),
        "blk.0.attn_norm.weight": (h,),
        "blk.0.ffn_norm.weight": (h,),
        "blk.0.attn_q.weight": (h, h),
        "blk.0.attn_k.weight": (16, h),
        "blk.0.attn_v.weight": (16, h),
        "blk.0.attn_output.weight": (h, h),
        "blk.0.ffn_gate.weight": (i, h),
        "blk.0.ffn_up.weight": (i, h),
        "blk.0.ffn_down.weight": (h, i),
    }
    for name, shape in (default | (shapes or {})).items():
        x = rng.standard_normal(shape).astype(np.float32)
        kind = kinds.get(name, Q.F32)
        if kind == Q.F16:
            writer.add_tensor(name, x.astype(np.float16))
        elif kind == Q.Q8_0:
            writer.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("hostile_gguf") / "tiny.gguf")
    model, tok = jaxlm.load(path, progress=False)
    assert tok.decode(tok.encode("a bc"), skip_special_tokens=True) == "a bc"
    return path, weights(model)


def test_hostile_gguf(gguf_file, tmp_path, record_property):
    """A truncated GGUF, or one with a bit flipped, loads or raises `LoadError` naming it.

    Exactly: a truncated file always raises `LoadError`. A flip before the tensor data (header,
    metadata, tokenizer; or the tensor table and its padding, drawn as often) raises `LoadError`
    or loads weights identical to the original (the config or tokenizer may differ: a flipped
    `rms_norm_eps` is still a model).
    A flip in the tensor data raises `LoadError` or loads weights of which only the tensor holding
    the flipped byte differs (in one element, or one Q8_0 block of 32), with its shape.
    """
    source, original = gguf_file
    data = source.read_bytes()
    reader = gguf.GGUFReader(source)
    start = reader.data_offset
    table = reader.tensors[0].field.offset
    ranges = {
        GGUF_NAMES[t.name]: (t.data_offset, t.data_offset + t.n_bytes) for t in reader.tensors
    }
    del reader
    tally = collections.Counter()

    @FUZZ
    @given(st.sampled_from(["header", "table", "data", "truncate"]), st.data())
    def check(region, draw):
        k = tally["tried"]
        tally["tried"] += 1
        target = tmp_path / f"m{k}.gguf"
        if region == "truncate":
            mutated = data[: draw.draw(st.integers(0, len(data) - 1))]
        else:
            low, high = {"header": (0, table), "table": (table, start)}.get(
                region, (start, len(data))
            )
            at = draw.draw(st.integers(low, high - 1))
            mutated = bytearray(data)
            mutated[at] ^= 1 << draw.draw(st.integers(0, 7))
        target.write_bytes(bytes(mutated))
        try:
            model, _ = jaxlm.load(target, progress=False)
        except LoadError as e:
            assert str(target) in str(e)
            tally["clear error"] += 1
            return
        assert region != "truncate", "a truncated file loaded"
        got = weights(model)
        assert got.keys() == original.keys()
        flipped = [n for n, (lo, hi) in ranges.items() if region == "data" and lo <= at < hi]
        for name, value in got.items():
            assert value.shape == original[name].shape
            allowed = 32 if name in flipped else 0
            assert differing(value, original[name]) <= allowed, name
        tally["loaded"] += 1

    check()
    record_property("hostile_gguf", dict(tally))
    print("\nhostile GGUF:", dict(tally))
    assert tally["clear error"] > 0


def test_gguf_shapes_contradicting_metadata(tmp_path):
    wide = write_tiny_gguf(tmp_path / "wide.gguf", shapes={"blk.0.ffn_up.weight": (65, 32)})
    with pytest.raises(LoadError, match=r"wide\.gguf: tensor `blk\.0\.ffn_up\.weight`"):
        jaxlm.load(wide)

    def many_layers(writer):
        writer.kv_data[0]["llama.block_count"].value = 2**30

    # A layer count from a corrupt file is checked against the tensors before anything is built.
    t = time.perf_counter()
    layers = write_tiny_gguf(tmp_path / "layers.gguf", metadata=many_layers)
    with pytest.raises(LoadError, match=r"layers\.gguf: metadata `llama\.block_count`"):
        jaxlm.load(layers)
    assert time.perf_counter() - t < 10


def test_gguf_tensor_table_must_follow_llama_cpp_layout(gguf_file, tmp_path):
    source, _ = gguf_file
    data = bytearray(source.read_bytes())
    reader = gguf.GGUFReader(source)

    # One bit turns the last tensor's type from F16 (1) into Q4_1 (3), whose data is smaller.
    def field_at(tensor, part: int) -> int:
        return tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:part])

    type_at = field_at(reader.tensors[-1], 4)
    assert data[type_at] == Q.F16
    data[type_at] = Q.Q4_1
    path = tmp_path / "retyped.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=r"retyped\.gguf: corrupt GGUF tensor table"):
        jaxlm.load(path)
    # The first tensor moved 32 bytes on, into its neighbour's data.
    data = bytearray(source.read_bytes())
    offset_at = field_at(reader.tensors[0], 5)
    data[offset_at : offset_at + 8] = struct.pack("<Q", 32)
    path = tmp_path / "moved.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=r"moved\.gguf: corrupt GGUF tensor table"):
        jaxlm.load(path)


# Hostile files: config.json and the tokenizer.

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, 2, 3, -1, 64, 2**31, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
ROPE = st.dictionaries(
    st.sampled_from(
        [
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ]
    ),
    JSON | st.sampled_from(["default", "linear", "dynamic", "llama3", "yarn"]),
    max_size=5,
)


def check_config(config: ModelConfig) -> None:
    """Every field of a config that was accepted has its documented type and range."""
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        value = getattr(config, name)
        assert type(value) is int and value > 0, name
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.head_dim % 2 == 0
    for name in ("rms_norm_eps", "rope_theta"):
        assert type(getattr(config, name)) is float and math.isfinite(getattr(config, name))
    assert config.rope_theta > 0 and config.rms_norm_eps >= 0
    scaling = config.rope_scaling
    assert scaling.rope_type in ("default", "linear", "dynamic", "llama3")
    assert math.isfinite(scaling.factor) and scaling.factor > 0
    if scaling.rope_type == "llama3":
        assert type(scaling.original_max_position_embeddings) is int
        assert 0 < scaling.low_freq_factor < scaling.high_freq_factor
    for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm"):
        assert type(getattr(config, flag)) is bool
    assert config.sliding_window is None or type(config.sliding_window) is int
    assert config.bos_token_id is None or type(config.bos_token_id) is int
    assert all(type(t) is int and t >= 0 for t in config.eos_token_id)


def test_hostile_configs(tiny_chat, record_property):
    """A `config.json` with keys removed or set to any JSON value gives a config whose every field
    has its documented type and range, or raises `LoadError`; never another exception."""
    base = json.loads((tiny_chat / "config.json").read_text())
    keys = [*sorted(base), "rope_scaling", "rope_theta", "sliding_window", "model_type"]
    tally = collections.Counter()

    @settings(FUZZ, max_examples=300)
    @given(
        st.lists(
            st.tuples(st.sampled_from(keys), st.none() | JSON | ROPE | st.just("delete")),
            min_size=1,
            max_size=4,
        ),
        st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]),
    )
    def check(changes, model_type):
        config = dict(base, model_type=model_type)
        for key, value in changes:
            if value == "delete":
                config.pop(key, None)
            else:
                config[key] = value
        tally["tried"] += 1
        try:
            result = ModelConfig.from_hf_config(config)
        except LoadError:
            tally["clear error"] += 1
            return
        check_config(result)
        tally["accepted"] += 1

    check()
    record_property("hostile_configs", dict(tally))
    print("\nhostile configs:", dict(tally))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ([1, 2], "should hold a JSON object, not list"),
        (b'{"model_type": "llama", \xff}', "not valid JSON"),
        ({"num_hidden_layers": "2"}, "`num_hidden_layers` must be a positive integer"),
        ({"num_attention_heads": 0, "head_dim": None}, "`num_attention_heads` must be a positive"),
        ({"hidden_size": None, "head_dim": None}, "`hidden_size` must be a positive integer"),
        ({"tie_word_embeddings": "false"}, "`tie_word_embeddings` must be true or false"),
        ({"rope_parameters": "default"}, "`rope_parameters` must be a JSON object"),
        ({"rms_norm_eps": float("nan")}, "`rms_norm_eps` must be a finite number"),
        ({"eos_token_id": "2"}, "`eos_token_id` must be a token id"),
        ({"max_position_embeddings": -5}, "`max_position_embeddings` must be a positive"),
        ({"num_hidden_layers": 10**9}, "`num_hidden_layers=1000000000`, the checkpoint has"),
        ({"hidden_size": 65}, r"`model\.embed_tokens\.weight` has shape \[320, 64\]"),
        ("delete vocab_size", "lacks `vocab_size`"),
    ],
)
def test_hostile_config_files(tiny_chat, tmp_path, change, match):
    config = json.loads((tiny_chat / "config.json").read_text())
    if isinstance(change, dict):
        content = json.dumps(config | change).encode()
    elif isinstance(change, str):
        del config[change.split()[1]]
        content = json.dumps(config).encode()
    else:
        content = change if isinstance(change, bytes) else json.dumps(change).encode()
    target = tmp_path / "m"
    mutated_copy(tiny_chat, target, "config.json", content)
    t = time.perf_counter()
    with pytest.raises(LoadError, match=match) as e:
        jaxlm.load(target, progress=False)
    assert str(target) in str(e.value)
    assert time.perf_counter() - t < 10


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("tokenizer.json", b"", "not a valid `tokenizers` file"),
        ("tokenizer.json", b"\x00\xff garbage", "not a valid `tokenizers` file"),
        ("tokenizer.json", b"[1, 2, 3]", "not a valid `tokenizers` file"),
        ("tokenizer.json", b'{"model": {"type": "BPE", "vocab": 5}}', "not a valid"),
        ("tokenizer_config.json", b"[]", "should hold a JSON object"),
        ("tokenizer_config.json", b"{\xff}", "not valid JSON"),
        ("tokenizer_config.json", b'{"eos_token": 5}', "`eos_token` should be a token's text"),
        ("tokenizer_config.json", b'{"chat_template": "{% for %}"}', "does not parse"),
        ("tokenizer_config.json", b'{"chat_template": 5}', "should be a string"),
        ("tokenizer_config.json", b'{"chat_template": [{"name": "x"}]}', "named `default`"),
        ("generation_config.json", b'{"eos_token_id": [1, "2"]}', "`eos_token_id` must be"),
        ("chat_template.jinja", b"{{ \xff", "not valid UTF-8"),
    ],
)
def test_hostile_tokenizer_files(tiny_chat, tmp_path, file, content, match):
    target = tmp_path / "m"
    if file == "chat_template.jinja":
        config = json.loads((tiny_chat / "tokenizer_config.json").read_text())
        del config["chat_template"]
        mutated_copy(tiny_chat, target, "tokenizer_config.json", json.dumps(config).encode())
        (target / file).write_bytes(content)
    else:
        mutated_copy(tiny_chat, target, file, content)
    with pytest.raises(LoadError, match=match) as e:
        jaxlm.load(target, progress=False)
    assert str(target / file) in str(e.value)


def test_fuzzed_tokenizer_files(tiny_chat, tmp_path, record_property):
    """A `tokenizer.json` with a bit flipped or cut short raises `LoadError` naming it, or loads
    a tokenizer that encodes and decodes without error.

    Through `open_checkpoint`, the part of `jaxlm.load` that reads the files before the weights:
    `test_hostile_tokenizer_files` checks that `jaxlm.load` passes its errors on."""
    data = (tiny_chat / "tokenizer.json").read_bytes()
    tally = collections.Counter()

    @FUZZ
    @given(st.integers(0, len(data) - 1), st.integers(-1, 7))
    def check(at, bit):
        k = tally["tried"]
        tally["tried"] += 1
        target = tmp_path / f"m{k}"
        mutated = bytearray(data)
        if bit < 0:
            del mutated[at:]
        else:
            mutated[at] ^= 1 << bit
        mutated_copy(tiny_chat, target, "tokenizer.json", bytes(mutated))
        try:
            tok = open_checkpoint(target).tokenizer
        except LoadError as e:
            assert str(target / "tokenizer.json") in str(e)
            tally["clear error"] += 1
            return
        assert isinstance(tok.decode(tok.encode("Héllo, 東京 😀")), str)
        tally["loaded"] += 1

    check()
    record_property("hostile_tokenizers", dict(tally))
    print("\nhostile tokenizer.json:", dict(tally))


# Hostile requests.

NAN, INF = float("nan"), float("inf")
TEMPERATURES = [None, 0.0, 1e-30, 1e-45, 0.7, 1e30, 3e38, NAN, INF, -1.0, True, "1"]
TOP_KS = [None, 0, 1, 5, 5.0, 319, 320, 321, 2**31 - 1, 2**31, -1, 2.5, NAN]
TOP_PS = [None, 1.0, 0.5, 1e-9, 0.0, 1.5, NAN, -0.5]
MIN_PS = [None, 0.0, 0.3, 1.0, -0.1, 1.1, NAN]
PENALTIES = [None, 1.0, 1e-30, 1e30, 3e38, INF, 0.0, -1.0, NAN]


# The documented limits of each sampling argument (`None` is always allowed: off).
SETTINGS = {
    "temperature": lambda v: math.isfinite(v) and v >= 0,
    "top_k": lambda v: float(v).is_integer() and 0 <= v < 2**31,
    "top_p": lambda v: 0 < v <= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: math.isfinite(v) and v > 0,
}


def valid_number(v, ok) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and ok(v))


def valid_request(vocab, prompt, new, sampling) -> bool:
    return (
        len(prompt) > 0
        and all(0 <= t < vocab for t in prompt)
        and new >= 1
        and all(valid_number(v, SETTINGS[k]) for k, v in sampling.items())
    )


def test_hostile_requests(chat, record_property):
    """Any prompt and sampling settings either generate ids in the vocabulary, at most
    `max_new_tokens` of them, or raise `ValueError` before any XLA work; nothing compiles."""
    for ids, new in chat.requests:
        chat.stream(ids, new, temperature=0.5)
    tally = collections.Counter()
    vocab = chat.vocab

    def mostly(good, bad):
        # Each argument is valid four times in five, so that a fair share of requests run.
        return st.sampled_from([0, 1, 2, 3, 4]).flatmap(lambda k: bad if k == 0 else good)

    def values(name, options):
        ok = [v for v in options if valid_number(v, SETTINGS[name])]
        return mostly(st.sampled_from(ok), st.sampled_from([v for v in options if v not in ok]))

    @settings(FUZZ, max_examples=200)
    @given(
        mostly(
            st.lists(st.integers(0, vocab - 1), min_size=1, max_size=32),
            st.lists(st.integers(-3, vocab + 3), max_size=32),
        ),
        mostly(st.sampled_from([1, 5, 16]), st.sampled_from([0, -1])),
        st.fixed_dictionaries(
            {
                name: values(name, options)
                for name, options in [
                    ("temperature", TEMPERATURES),
                    ("top_k", TOP_KS),
                    ("top_p", TOP_PS),
                    ("min_p", MIN_PS),
                    ("repetition_penalty", PENALTIES),
                ]
            }
        ),
        st.booleans(),
    )
    def check(prompt, new, sampling, streamed):
        tally["tried"] += 1
        valid = valid_request(vocab, prompt, new, sampling)
        with jaxlm.CompileCounter() as compiles:
            if not valid:
                call = jaxlm.stream if streamed else jaxlm.generate
                with pytest.raises(ValueError):
                    call(chat.model, chat.tok, prompt, max_new_tokens=new, **sampling)
                tally["clear error"] += 1
            elif streamed:
                text = chat.stream(prompt, new, **sampling)
                assert isinstance(text, str)
                tally["generated"] += 1
            else:
                out = chat.generate(prompt, new, **sampling)
                assert len(out) <= new and all(0 <= t < vocab for t in out)
                tally["generated"] += 1
        assert compiles.builds == 0

    check()
    record_property("hostile_requests", dict(tally))
    print("\nhostile requests:", dict(tally))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(temperature=10**400), id="temperature-huge-int"),
        pytest.param(dict(top_k=10**400), id="top_k-huge-int"),
        pytest.param(dict(repetition_penalty=10**400), id="penalty-huge-int"),
        pytest.param(dict(prompts=None), id="prompts-none"),
        pytest.param(dict(prompts=5), id="prompts-int"),
        pytest.param(dict(stop_token_ids=5), id="stop_token_ids-int"),
        pytest.param(dict(stop=5), id="stop-int"),
        pytest.param(dict(stop_token_ids=[1.5]), id="stop_token_ids-float"),
    ],
)
def test_requests_of_the_wrong_type(chat, kwargs):
    args = dict(prompts=[5, 6], max_new_tokens=4) | kwargs
    with jaxlm.CompileCounter() as compiles, pytest.raises(ValueError):
        jaxlm.generate(chat.model, chat.tok, args.pop("prompts"), **args)
    assert compiles.builds == 0


@pytest.mark.parametrize(
    "prompts",
    [[""], ["a", ""], [[1, 2], []], [], [[1.5, 2]], [["a"]], [[1, 2], None]],
)
def test_empty_or_mixed_prompts(chat, prompts):
    with jaxlm.CompileCounter() as compiles, pytest.raises(ValueError):
        jaxlm.generate(chat.model, chat.tok, prompts, max_new_tokens=4)
    assert compiles.builds == 0


def test_very_long_prompt_against_a_plan(chat):
    plan = jaxlm.plan(chat.model, max_batch=1, max_seq_len=48)
    with jaxlm.CompileCounter() as compiles:
        with pytest.raises(jaxlm.PlanError, match="exceeds the plan's `max_seq_len=48`"):
            jaxlm.generate(chat.model, chat.tok, "word " * 5000, max_new_tokens=4, plan=plan)
        with pytest.raises(jaxlm.PlanError, match="`max_new_tokens=100`"):
            jaxlm.generate(chat.model, chat.tok, [5, 6], max_new_tokens=100, plan=plan)
    assert compiles.builds == 0


def test_top_k_beyond_the_vocabulary_is_off(chat):
    ids, new = chat.requests[0]
    off = chat.generate(ids, new, temperature=1.0, seed=3)
    assert off != chat.generate(ids, new, temperature=1.0, seed=3, top_k=2)
    for k in (chat.vocab, chat.vocab + 1, 2**31 - 1):
        assert chat.generate(ids, new, temperature=1.0, seed=3, top_k=k) == off


def test_byte_tokens_decode_to_replacement_characters(chat):
    """Ids of byte tokens that form invalid UTF-8 decode as Python's `errors="replace"` does,
    and a stream of them releases the same text in the end, however the ids arrive."""
    tok = chat.tok
    ids = [tok.backend.token_to_id(char) for char in byte_chars()]
    assert None not in ids

    @settings(FUZZ, max_examples=100)
    @given(
        st.lists(st.integers(0, 255), max_size=12),
        st.lists(st.integers(1, 4), min_size=1, max_size=12),
    )
    def check(raw, cuts):
        token_ids = [ids[b] for b in raw]
        expected = bytes(raw).decode("utf-8", errors="replace")
        assert tok.decode(token_ids) == expected
        detok, pieces, n = Detokenizer(tok, ()), [], 0
        for cut in cuts:
            n = min(n + cut, len(token_ids))
            pieces.append(detok.update(token_ids[:n], final=False))
        pieces.append(detok.update(token_ids, final=True))
        assert "".join(pieces) == expected

    check()
    invalid = [ids[0xC3], ids[0x28], ids[0xE2], ids[0x82], ids[0xFF]]
    assert tok.decode(invalid) == "\ufffd(\ufffd\ufffd"
    out = jaxlm.generate(chat.model, tok, [invalid, invalid[:2]], max_new_tokens=6)
    assert len(out) == 2 and all(isinstance(o.text, str) for o in out)
    streamed = list(jaxlm.stream(chat.model, tok, invalid, max_new_tokens=6))
    (whole,) = jaxlm.generate(chat.model, tok, invalid, max_new_tokens=6)
    assert "".join(d.text for d in streamed) == whole.text
    assert [t for d in streamed for t in d.token_ids] == whole.token_ids
    assert streamed[-1].finish_reason == whole.finish_reason
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        tok.decode([5, -1])


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (`bytes_to_unicode`)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


# Numerical guards.


def test_non_finite_weights_are_reported_at_load(tmp_path):
    hf = tmp_path / "hf"
    make_hf_model(hf, "llama_gqa4")
    file = hf / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = torch.nan
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        LoadError,
        match=r"model\.safetensors: tensor `model\.layers\.1\.mlp\.up_proj\.weight` holds 1 NaN",
    ):
        jaxlm.load(hf, progress=False)
    model, _ = jaxlm.load(hf, progress=False, check_finite=False)
    assert np.isnan(weights(model)["model.layers.1.mlp.up_proj.weight"]).sum() == 1

    clean = write_tiny_gguf(tmp_path / "clean.gguf")
    data = bytearray(clean.read_bytes())
    at = next(t.data_offset for t in gguf.GGUFReader(clean).tensors if "ffn_norm" in t.name)
    data[at : at + 4] = struct.pack("<f", INF)
    path = tmp_path / "inf.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=r"inf\.gguf: tensor `blk\.0\.ffn_norm\.weight` \("):
        jaxlm.load(path, progress=False)
    jaxlm.load(path, progress=False, check_finite=False)

    # A float32 value beyond float16's range would become infinite in a float16 model.
    tensors = load_file(file)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = 1e6
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(LoadError, match="beyond the range of `float16`"):
        jaxlm.load(hf, dtype=np.float16, progress=False)
    jaxlm.load(hf, dtype=np.float32, progress=False)
    model, _ = jaxlm.load(hf, dtype=np.float16, progress=False, check_finite=False)
    assert np.isinf(weights(model)["model.layers.1.mlp.up_proj.weight"]).sum() == 1


def test_requests_beyond_the_context_without_a_plan(tiny_chat):
    model, tok = jaxlm.load(tiny_chat, progress=False)
    with jaxlm.CompileCounter() as compiles:
        for prompt, new in [([5, 6], 10**9), ("word " * 5000, 4), ([5] * 120, 9)]:
            with pytest.raises(ValueError, match="`max_position_embeddings=128`"):
                jaxlm.generate(model, tok, prompt, max_new_tokens=new)
            with pytest.raises(ValueError, match="`max_position_embeddings=128`"):
                jaxlm.stream(model, tok, prompt, max_new_tokens=new)
    assert compiles.builds == 0
