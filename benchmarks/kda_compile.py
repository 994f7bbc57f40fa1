"""Compile the KDA kernels for a GPU target without a GPU: registers, spills, shared memory.

    python benchmarks/kda_compile.py [--arch 90] [--warps 2 4 8]

The KDA launches of ``benchmarks/kernel_compile.py`` (which says how to read the figures):
bf16 operands, K = V = 128, chunk 64.
"""

from __future__ import annotations

import sys

from kernel_compile import main

if __name__ == "__main__":
    sys.exit(main(module="kda"))
