"""`LLMEngine` on a mesh of simulated CPU devices, against the same engine on one device.

Runs in the process of 4 devices that `tests/test_sharding.py` starts.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys

import httpx
import jax
import pytest
from conftest import make_hf_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from serve_helpers import free_port, wait_until_healthy

import jaxlm

# A tiny engine: chunks of 16 prompt tokens, so it compiles two step widths.
SIZES = dict(max_num_seqs=4, page_size=4, num_pages=96, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_gqa4")
    make_hf_model(path, "llama_gqa4")
    return path


def requests(vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [
        ([rng.randrange(vocab) for _ in range(rng.choice([3, 9, 20, 37]))], rng.randint(4, 16))
        for _ in range(16)
    ]


def run(model, speculative=None) -> tuple[list[list[int]], jaxlm.EngineStats]:
    with jaxlm.LLMEngine(model, speculative=speculative, **SIZES) as engine:
        handles = [
            engine.submit(p, max_new_tokens=n, stop_token_ids=[])
            for p, n in requests(model.config.vocab_size)
        ]
        out = [h.result().token_ids for h in handles]
        assert engine.stats().pages_in_use == 0
        # Over `data`, the requests ran on every shard's slots and pages.
        data = engine.plan.mesh.shape["data"] if engine.plan.mesh else 1
        assert {h.seq.shard for h in handles} == set(range(data))
        if engine.plan.mesh:
            split = NamedSharding(engine.plan.mesh, P("data" if data > 1 else None, "model"))
            assert all(x.sharding.is_equivalent_to(split, 4) for x in jax.tree.leaves(engine.pages))
        return out, engine.stats()


@pytest.fixture(scope="module")
def single(saved):
    model, _ = jaxlm.load(saved)
    return run(model)[0]


@pytest.mark.parametrize("mesh", [(1, 2), (2, 1), (2, 2)], ids=str)
def test_sixteen_requests_on_a_mesh_equal_one_device(saved, single, mesh):
    model, _ = jaxlm.load(saved, mesh=mesh)
    assert run(model)[0] == single


def test_a_draft_model_drafts_on_a_mesh_as_on_one_device(saved, single):
    # A draft of the model's own weights, its pages split as the model's: every draft is kept.
    model, _ = jaxlm.load(saved, mesh=(2, 2))
    draft, _ = jaxlm.load(saved, mesh=(2, 2))
    out, stats = run(model, speculative=draft)
    assert out == single
    assert stats.drafted_tokens == stats.accepted_tokens > 0


def test_pages_split_by_data_and_kv_head_and_stay_in_place(saved):
    model, _ = jaxlm.load(saved, mesh=(2, 2))
    # With the step that verifies drafts, which must keep its pages in place too.
    plan = jaxlm.plan(model, speculative="ngram", **SIZES)
    c = model.config
    slot = plan.layout.slots[0]
    # Each shard of `data` holds the pages of its own slots, their KV heads split over `model`.
    spec = P("data", "model", None, None)
    assert slot.sharding.spec == spec
    assert slot.shard_shape == (96 // 2, c.num_key_value_heads // 2, c.head_dim, 4)
    with jaxlm.LLMEngine(model, plan=plan) as engine:
        assert [p.num_pages for p in engine.pools] == [96 // 2] * 2
        pages = jax.tree.leaves(engine.pages)
        assert all(x.sharding.spec == spec for x in pages)
        # The bill is per device: each of the four holds a quarter of the pages.
        assert sum(x.addressable_shards[0].data.nbytes for x in pages) == plan.scratch_bytes
        assert sum(x.nbytes for x in pages) == 4 * plan.scratch_bytes
        before = [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in pages]
        prompts, kw = [[1, 2, 3] * 7, [4, 5]], dict(max_new_tokens=12, stop_token_ids=[])
        drafted = engine.generate(prompts, **kw)
        assert [r.token_ids for r in drafted] == [
            r.token_ids for r in engine.generate(prompts, speculative=None, **kw)
        ]
        after = jax.tree.leaves(engine.pages)
        assert [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in after] == (
            before
        )
    for width, executable in plan.compiled.items():
        memory = plan.executables[width]
        assert memory.alias >= plan.scratch_bytes, width
        shape = re.escape(",".join(map(str, slot.shard_shape)))
        assert not re.search(rf"= f32\[{shape}\]\S* copy\(", executable.as_text()), width


def test_a_budget_fits_pages_for_every_shard(saved):
    model, _ = jaxlm.load(saved, mesh=(2, 1))
    sizes = {k: v for k, v in SIZES.items() if k != "num_pages"}
    plan = jaxlm.plan(model, budget="1MiB", **sizes)
    assert plan.num_pages % 2 == 0 and plan.total_bytes <= 1 << 20
    # The bill is per device, whose shard holds half the pages; one more would not fit.
    assert plan.total_bytes + plan.scratch_bytes // (plan.num_pages // 2) > 1 << 20
    with jaxlm.LLMEngine(model, plan=plan) as engine:
        pages = jax.tree.leaves(engine.pages)
        assert sum(x.addressable_shards[0].data.nbytes for x in pages) == plan.scratch_bytes


@pytest.mark.parametrize(
    ("sizes", "name"),
    [(dict(max_num_seqs=3, num_pages=96), "max_num_seqs=3"), (dict(num_pages=95), "num_pages=95")],
)
def test_engine_sizes_must_split_over_data(saved, sizes, name):
    model, _ = jaxlm.load(saved, mesh=(2, 1))
    with pytest.raises(ValueError, match=rf"`{name}` is not a multiple of the mesh axis `data`"):
        jaxlm.LLMEngine(model, **{**SIZES, **sizes})


def test_serve_on_a_two_by_two_mesh(tiny_chat):
    prompt = "Once upon a time"
    model, tokenizer = jaxlm.load(tiny_chat)
    want = jaxlm.generate(model, tokenizer, prompt, max_new_tokens=12, stop_token_ids=[])
    port = free_port()
    command = [sys.executable, "-m", "jaxlm", "serve", "--model", str(tiny_chat), "--mesh", "2,2"]
    command += ["--port", str(port), "--max-num-seqs", "2", "--max-seq-len", "64"]
    command += ["--max-num-batched-tokens", "16"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, timeout=240)
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = proc.stderr.read()
    # The engine's plan, per device on the mesh, is printed as the server starts.
    assert "mesh data=2 x model=2" in log and "k_pages" in log and "Traceback" not in log
