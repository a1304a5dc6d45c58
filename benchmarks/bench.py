"""The offline benchmark grid: the same as `jaxlm bench` (see `jaxlm/bench/` and README.md).

Usage: python benchmarks/bench.py [--batch 1,4,8] [--prompt-len 32,128,512] [--new-tokens 128]
                                  [--repeats 3] [--vs transformers] [--vs llama.cpp] [--json PATH]
"""

import sys

from jaxlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
