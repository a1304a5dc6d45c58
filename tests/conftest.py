"""Shared fixtures: tiny random-weight Hugging Face models saved with `save_pretrained`."""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

# One persistent compilation cache for the whole run, the processes it starts (notebooks, the
# command line, the multi-device run) included: steps that compile to the same executable, for
# each of the many models the tests load, are compiled once and loaded after that. A test that
# checks that nothing compiles counts `CompileCounter.builds`, loads from this cache included.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxlm-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# XLA:CPU's LLVM optimizations take about a third of compiling and only make the machine code
# faster: what XLA computes, its buffers and their aliasing are settled before them, and no
# test times anything. XLA:CPU's older fusion emitters compile a two-layer model's steps in 0.4
# of the time of the new ones but the default model's in 1.45 (`docs/performance.md`, "The test
# suite's compiling"): the tests, mostly of two-layer models, take the older ones; the processes
# they start to run the default model (notebooks, the command line), and the worker that runs
# the default model's files (`FIRST_WORKER`), the new ones, with `DEFAULT_MODEL_FLAGS`. The
# child processes inherit the flags.
DEFAULT_MODEL_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# The older emitters' module compiles as one part: split, its parts are cloned to compile side by
# side, which the suite's two busy cores cannot do anyway.
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
FAST_COMPILE_FLAGS = f"{DEFAULT_MODEL_FLAGS} {OLDER_EMITTERS}"
if FAST_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()


def default_model_env(**changes: str) -> dict:
    """The environment, with `changes`, of a process started to run the default model."""
    flags = os.environ["XLA_FLAGS"].replace(FAST_COMPILE_FLAGS, DEFAULT_MODEL_FLAGS)
    return {**os.environ, "XLA_FLAGS": flags, **changes}


# `multidevice` needs 4 devices, which XLA fixes at start-up: `test_sharding.py` runs it in a
# process of its own.
_SIMULATED_DEVICES = "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
collect_ignore = [] if _SIMULATED_DEVICES else ["multidevice"]

ROOT = Path(__file__).resolve().parent.parent
# llama.cpp's greedy ids and tokenizer ids for the default model (`tests/data/README.md`).
SMOLLM2_LLAMACPP = json.loads((ROOT / "tests" / "data" / "smollm2_llamacpp.json").read_text())
# Chat requests to the default model whose answers repeat their prompt, and some that do not.
CHATS = [
    "Copy this sentence exactly: The old bridge over the river was closed for repairs in May, "
    "and the ferry carried everyone across until the autumn.",
    "Repeat after me: red, green, blue, red, green, blue, red, green, blue.",
    "Add a comment to this code and return it:\n\ndef area(w, h):\n    return w * h\n",
    "Fix the spelling and give the text back: The wether was cold and the childs stayed inside.",
    "Write a haiku about winter.",
]

# The tests carry their own data: every file they open lies in the repository, in a temporary
# directory, in what the interpreter and its packages (the default model included) and the
# operating system install, or in the user's hidden settings (`pdb` reads `~/.pdbrc`); never in
# the project's `shared` folder beside the repository, even where that lies in a temporary
# directory (a clone in /tmp). `opened_outside` is checked once the session ends.
ALLOWED_ROOTS = (
    *dict.fromkeys(
        os.path.realpath(p) + os.sep
        for p in (
            ROOT,
            tempfile.gettempdir(),
            sys.prefix,
            sys.base_prefix,
            *("/dev", "/etc", "/lib", "/proc", "/sys", "/usr"),
        )
    ),
    os.path.join(os.path.realpath(Path.home()), "."),
)
BESIDE = os.path.realpath(ROOT.parent / "shared") + os.sep
opened_outside: set[str] = set()


def _outside(path: str) -> bool:
    path += os.sep
    return path.startswith(BESIDE) or not path.startswith(ALLOWED_ROOTS)


def _audit_open(event: str, args: tuple) -> None:
    # Called for every `open` of the process: cheap string checks before `realpath`.
    if event == "open" and isinstance(args[0], str | Path):
        path = os.path.abspath(args[0])
        if _outside(path) and _outside(os.path.realpath(path)):
            opened_outside.add(path)


sys.addaudithook(_audit_open)


# The two workers (pyproject.toml) take a group of files at a time, so that their module and
# session fixtures load once, the slowest first so that both finish together. A file is a group
# of its own, except those that share the default model's served engine (`served_default`).
GROUPS = {"test_structured.py": "test_serve.py"}
# Seconds per file in a run of the whole suite on 2 cores, from its `--durations=0` (on a
# machine shared with other runs: only their order counts); the others take less.
FILE_SECONDS = {
    "test_notebooks.py": 180,
    "test_serve.py": 165,
    "test_sharding.py": 135,
    "test_default_model.py": 105,
    "test_llm_engine.py": 95,
    "test_plan.py": 85,
    "test_bench.py": 85,
    "test_moe.py": 80,
    "test_multihost.py": 80,
    "test_int8.py": 70,
    "test_cli.py": 65,
    "test_structured.py": 65,
    "test_families.py": 60,
    "test_reliability.py": 55,
    "test_generate.py": 50,
    "test_speculative.py": 50,
    "test_gguf.py": 45,
    "test_int4.py": 35,
    "test_models.py": 35,
    "test_speculative_engine.py": 30,
    "test_phi3.py": 25,
    "test_paged.py": 20,
    "test_draft_model.py": 20,
    "test_serve_attack.py": 20,
    "test_kernels.py": 20,
    "test_sampling.py": 20,
    "test_device_check.py": 15,
    "test_llm_engine_sampling.py": 10,
}


# The first of the two workers takes these files first: those that run the default model in
# this process, which it compiles with the new emitters, those whose time goes to the
# processes they start, with flags of their own, and, to balance the two, tiny models' files
# that spend little of their time compiling (the new emitters compile tiny models' steps in
# about twice the time). The second takes the others first.
FIRST_WORKER = "gw0"
FIRST_WORKER_FILES = {
    "test_serve.py",
    "test_notebooks.py",
    "test_default_model.py",
    "test_sharding.py",
    "test_cli.py",
    "test_multihost.py",
    "test_gguf.py",
    "test_kernels.py",
}


def _file(path: str) -> str:
    return path.split("::", 1)[0].rsplit("/", 1)[-1]


def _group(path: str) -> str:
    name = _file(path)
    return GROUPS.get(name, name)


def pytest_configure(config):
    # Before anything starts XLA, which reads its flags once.
    if getattr(config, "workerinput", {}).get("workerid") == FIRST_WORKER:
        os.environ["XLA_FLAGS"] = default_model_env()["XLA_FLAGS"]


def pytest_collection_modifyitems(config, items):
    seconds = collections.Counter()
    for name, t in FILE_SECONDS.items():
        seconds[_group(name)] += t
    items.sort(key=lambda item: -seconds[_group(item.nodeid)])


def pytest_xdist_make_scheduler(config, log):
    # `--dist loadfile`'s scheduling, by group of files. (xdist's own `loadgroup` marks no
    # longer take with pytest 9, which keeps a node's id elsewhere.)
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

        def _assign_work_unit(self, node) -> None:
            # A worker takes the slowest group of its own first, else the fastest of the other's.
            first = node.gateway.id == FIRST_WORKER
            groups = list(self.workqueue)
            own = [g for g in groups if (_file(g) in FIRST_WORKER_FILES) == first]
            self.workqueue.move_to_end(own[0] if own else groups[-1], last=False)
            super()._assign_work_unit(node)

    return ByGroup(config, log)


def pytest_collection_finish(session):
    # torch, transformers and the test modules leave about half a million objects that live
    # as long as the process: each full collection walked them all, a quarter of a second,
    # and every plan collects twice to measure its executables' host memory. Frozen, the
    # collector skips them, and what each test file leaves once the next file starts (below).
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _earlier_files_objects_frozen():
    # JAX keeps the trace of every step it compiled, so a worker's full collections grew with
    # the files it had run. What earlier files left is collected once here and the rest
    # frozen (`docs/performance.md`, "The test suite's compiling").
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _nothing_opened_outside_the_repository():
    yield
    assert not opened_outside, f"tests opened files outside the repository: {opened_outside}"


BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)

# The full-size Llama-3.1-8B config, for abstract models.
LLAMA_31_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
)

# Each family: (transformers config class, model class, config overrides).
FAMILIES = {
    "llama_gqa4": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_gqa3_tied_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=6,
            num_key_value_heads=2,
            hidden_size=48,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        ),
    ),
    "llama_dynamic": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            max_position_embeddings=8,
            rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
        ),
    ),
    "llama3_scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 50000.0,
            }
        ),
    ),
    "llama_biases": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, num_key_value_heads=8),
    ),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
}


def make_hf_model(path: Path, family: str, dtype=torch.float32, seed: int = 0, **save_kwargs):
    """Save a random tiny model of `family` to `path`.

    Returns the reference: transformers' model loaded back from `path` in float32.
    """
    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # Random init gives norms of exactly 1 and biases of 0; perturb them so they are tested too.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, **save_kwargs)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def live_executables_after(load: str) -> list[str]:
    """The names of the executables still alive after `load`, a call to `jaxlm.load` run in a
    fresh process, so that no earlier load has compiled anything.
    """
    script = (
        "import jax, jax.extend, jaxlm\n"
        f"model, _ = {load}\n"
        "live = jax.extend.backend.get_backend().live_executables()\n"
        "print(*(e.hlo_modules()[0].name for e in live))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.split()


def padded_batch(vocab: int, lengths: list[int], side: str, seed: int = 0):
    """Random ids `[batch, max_len]`, a mask with each row's real tokens on one side, positions."""
    rng = np.random.default_rng(seed)
    t = max(lengths)
    ids = rng.integers(0, vocab, (len(lengths), t))
    mask = np.zeros((len(lengths), t), np.int64)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, t - n :] = 1
        else:
            mask[i, :n] = 1
    positions = np.maximum(mask.cumsum(1) - 1, 0)
    return ids, mask, positions


def hf_logits(model, ids, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


@functools.partial(nnx.jit, static_argnames="masked")
def _forward(model, ids, mask, masked: bool):
    return model(ids, attention_mask=mask) if masked else model(ids)


def forward(model, ids, attention_mask=None) -> np.ndarray:
    """The logits of `model(ids, attention_mask=attention_mask)`, the call compiled whole.

    Eagerly, each of the forward's operations compiles on its own for each new shape and
    sharding, three to four times the time a tiny model's whole forward takes to compile. The
    eager call itself is `tests/test_models.py`'s to check, and on a mesh that of
    `tests/multidevice/test_mesh.py::test_shard_moves_a_loaded_model`.
    """
    masked = attention_mask is not None
    return np.asarray(_forward(model, np.asarray(ids), attention_mask, masked=masked))


def rewrite_config(path: Path, **changes) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


@pytest.fixture
def small_buckets(monkeypatch):
    """Attention reads the filled part of a cache in buckets of 8 slots doubling, not 256, so
    that tiny models switch among them. Traces made with either size are dropped on the way in
    and out, since `jax.jit` keys them by shapes, not by this module constant."""
    jax.clear_caches()
    monkeypatch.setattr("jaxlm.ops.attention.FILLED_BUCKET", 8)
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A saved tiny Llama (GQA 4:1) directory and its transformers model."""
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_hf_model(path, "llama_gqa4")


@pytest.fixture(scope="session")
def smollm2():
    """The default model and its tokenizer."""
    import jaxlm

    return jaxlm.load()


@pytest.fixture(scope="session")
def served_default(smollm2):
    """`(Running, engine)`: the default model's engine served as `smollm2`, shared by the files
    of its group (`GROUPS`): compiling its steps takes half a minute."""
    from serve_helpers import served_default_engine

    with served_default_engine(*smollm2, "smollm2") as served:
        yield served


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time, in a small village, there lived a cat named Émile.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Ünïcödé wörds, café, naïve, 東京, 😀 emoji and more text to learn merges from.",
] * 20


def save_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer with ChatML special tokens into `path`; returns its size."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "chat_template": CHATML,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory):
    """A saved tiny Llama with a trained byte-level tokenizer and a ChatML chat template."""
    path = tmp_path_factory.mktemp("tiny_chat")
    vocab = save_tokenizer(path)
    config = transformers.LlamaConfig(**{**BASE, "vocab_size": vocab, "eos_token_id": 0})
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path
