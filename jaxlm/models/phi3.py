"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's decoder with LongRoPE, partial rotary embeddings and
fused projections in the checkpoints.

- The checkpoints hold the queries, keys and values as one tensor, `qkv_proj.weight` `[q + 2 *
  kv rows, hidden]`, and gate and up as one, `gate_up_proj.weight` `[2 * intermediate,
  hidden]`; the loader cuts them into the model's grouped and stacked parameters (see
  `jaxlm.loading.names.FUSED`).
- Only the first `rotary_dim = int(head_dim * partial_rotary_factor)` features of each head
  rotate (Phi-4-mini: 96 of 128); the others pass unchanged (`jaxlm.layers.apply_rope`).
- LongRoPE (`rope_type` `longrope`, `su` in older configs) divides each frequency by its entry
  of `short_factor` or `long_factor`, and scales `cos` and `sin` by `attention_factor`.
  transformers' forward takes the long factors for all its positions once its largest position
  reaches `original_max_position_embeddings`. jaxlm chooses so for each row of each call (a
  prefill chunk, a decoded token), so that a row's tokens never depend on the other rows of its
  batch: a sequence that stays within the original context, or whose prompt is beyond it and
  prefilled in one chunk, decodes exactly as transformers' `generate` does. Where a sequence
  crosses the original length in a later call, the keys already cached keep the short factors'
  rotation, while transformers' `generate` computes the whole sequence again with the long
  factors at that step (`Phi3ForCausalLM.prepare_inputs_for_generation`); the two differ from
  there on. A padded batch whose rows straddle the original length differs from transformers'
  forward of the whole batch, which chooses by its longest row.
- Where the config sets a `sliding_window`, every layer attends over it, as in transformers.
"""

from __future__ import annotations

from jaxlm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """A Phi-3 causal language model (`model_type` `phi3`), used as `LlamaForCausalLM` is.

    Example:
        >>> model, tokenizer = jaxlm.load("path/to/Phi-3.5-mini-instruct")
        >>> jaxlm.generate(model, tokenizer, "The capital of France is", max_new_tokens=16)[0].text
    """
