"""`jaxlm bench`: the offline grid that inference engines publish, for jaxlm and optionally others.

For every cell of batch sizes x prompt lengths x new tokens it measures, with medians over
repeats:
- prefill tokens/s and time to first token, from a `generate` of one new token;
- decode tokens/s, from the difference between `N` new tokens and one, per row and in total;
- compile time: cold (an empty persistent compilation cache), and from JAX's persistent cache
  once the cell has run (after `jax.clear_caches()`, as a second start would);
- memory: the process's peak RSS while the cell generates (its high-water mark reset after
  compiling) and its current RSS, against the plan's resident bill (the whole bill and the
  compiled steps' host memory) plus the RSS the process had before it loaded the model.

Prompts are random token ids of exactly the prompt length (fixed seed), decoding is greedy and no
token stops a row, so every row generates all its tokens. A probe measures the machine's memory
read bandwidth, and each decode figure is shown as a fraction of the speed that bandwidth allows
when every step reads all the weights once. `--vs transformers` and `--vs llama.cpp` run the same
cells on the same weights, interleaved with jaxlm repeat by repeat, and print the ratios pair by
pair.

Run `jaxlm bench --help` or `python benchmarks/bench.py --help`.
"""

from .grid import (
    DEFAULT_BATCH,
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT_LEN,
    ENGINES,
    SEED,
    add_arguments,
    random_prompts,
    run,
    summarize,
    throughput,
)
from .report import format_report, text_table
from .runners import (
    JaxlmRunner,
    LlamaCppRunner,
    TransformersRunner,
    llama_cpp_status,
    to_transformers,
)
from .system import (
    OtherLoad,
    cores,
    current_rss,
    memory_bandwidth,
    peak_rss,
    persistent_cache,
    reset_peak_rss,
)

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_NEW_TOKENS",
    "DEFAULT_PROMPT_LEN",
    "ENGINES",
    "SEED",
    "JaxlmRunner",
    "LlamaCppRunner",
    "OtherLoad",
    "TransformersRunner",
    "add_arguments",
    "cores",
    "current_rss",
    "format_report",
    "llama_cpp_status",
    "memory_bandwidth",
    "peak_rss",
    "persistent_cache",
    "random_prompts",
    "reset_peak_rss",
    "run",
    "summarize",
    "text_table",
    "throughput",
    "to_transformers",
]
