"""The engines a cell runs: jaxlm, and transformers or llama.cpp on the same weights."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .system import cores


class JaxlmRunner:
    """Runs one cell's `generate` calls on a plan made for exactly that cell."""

    name = "jaxlm"

    def __init__(self, model):
        self.model = model

    def plan(self, batch: int, prompt_len: int, new_tokens: int):
        """The plan `generate` makes for this cell."""
        from jaxlm.plans import request_plan

        return request_plan(self.model, batch, prompt_len, new_tokens)

    def generate(self, prompts, new_tokens: int, plan) -> tuple[float, list[list[int]]]:
        import jaxlm

        t = time.perf_counter()
        out = jaxlm.generate(
            self.model, None, prompts, max_new_tokens=new_tokens, stop_token_ids=[], plan=plan
        )
        return time.perf_counter() - t, [o.token_ids for o in out]


class TransformersRunner:
    """transformers' `generate` on a `LlamaForCausalLM` holding the jaxlm model's weights."""

    name = "transformers"

    def __init__(self, model):
        import torch

        torch.set_num_threads(cores())
        self.torch = torch
        self.model = to_transformers(model)

    def generate(self, prompts, new_tokens: int, plan=None) -> tuple[float, list[list[int]]]:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            elapsed = time.perf_counter() - t
        return elapsed, out[:, ids.shape[1] :].tolist()


def to_transformers(model):
    """A transformers causal LM with the same configuration and weights as a jaxlm `model`."""
    import torch
    import transformers

    from jaxlm.loading import checkpoint_tensors

    c = model.config
    rope = {"rope_type": c.rope_scaling.rope_type, "rope_theta": c.rope_theta}
    if c.rope_scaling.rope_type != "default":
        rope["factor"] = c.rope_scaling.factor
    if c.rope_scaling.rope_type == "llama3":
        rope.update(
            low_freq_factor=c.rope_scaling.low_freq_factor,
            high_freq_factor=c.rope_scaling.high_freq_factor,
            original_max_position_embeddings=c.rope_scaling.original_max_position_embeddings,
        )
    kwargs = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        rope_parameters=rope,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_id) or None,
    )
    if c.sliding_window is not None:
        kwargs["sliding_window"] = c.sliding_window
    config = transformers.AutoConfig.for_model(c.model_type, **kwargs)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        str(model.dtype)
    ]
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    state = {}
    for name, value in checkpoint_tensors(model).items():
        if value.dtype == np.uint16:
            # A table stored as the bits of the model's dtype (see `jaxlm.layers.Embedding`).
            value = value.view(model.dtype)
        value = np.array(value, np.float32)
        state[name] = torch.from_numpy(value).to(dtype)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"weights do not match transformers: missing {missing}, extra {unexpected}"
        )
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf


class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) on a GGUF file, batch 1, greedy (argmax on the host)."""

    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int):
        import llama_cpp
        from llama_cpp import llama as high_level

        self.llama_cpp = llama_cpp
        self.perf: dict | None = None
        defaults = high_level.llama_cpp.llama_model_default_params

        def model_params():
            params = defaults()
            # llama.cpp's extra (AMX) buffers crash on quantized files on some CPUs; the
            # `Llama` constructor has no argument for this field of its model parameters.
            params.use_extra_bufts = False
            return params

        high_level.llama_cpp.llama_model_default_params = model_params
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=min(n_ctx, 512),
                n_threads=cores(),
                n_threads_batch=cores(),
                verbose=False,
            )
        finally:
            high_level.llama_cpp.llama_model_default_params = defaults
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts, new_tokens: int, plan=None) -> tuple[float, list[list[int]]]:
        (prompt,) = prompts
        llm, lib = self.llm, self.llama_cpp
        llm.reset()
        lib.llama_memory_clear(lib.llama_get_memory(llm.ctx), True)
        lib.llama_perf_context_reset(llm.ctx)
        t = time.perf_counter()
        llm.eval(prompt)
        out = [self._argmax()]
        while len(out) < new_tokens:
            llm.eval(out[-1:])
            out.append(self._argmax())
        elapsed = time.perf_counter() - t
        perf = lib.llama_perf_context(llm.ctx)
        self.perf = {
            "prompt_tokens": perf.n_p_eval,
            "prompt_ms": perf.t_p_eval_ms,
            "eval_tokens": perf.n_eval,
            "eval_ms": perf.t_eval_ms,
        }
        return elapsed, [out]


def llama_cpp_status() -> str | None:
    """None if llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"`llama_cpp` (llama-cpp-python) is not installed ({e}); skipped"
    return None
