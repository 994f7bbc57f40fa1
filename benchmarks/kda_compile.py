"""Compile the KDA kernels for a GPU target without a GPU: registers, spills, shared memory.

    python benchmarks/kda_compile.py [--arch 90] [--warps 2 4 8]

Device time is scarce; this shows on any machine whether a launch configuration spills
before it is timed (a spilling kernel is rarely the fast one). It compiles with the installed
Triton and its bundled ``ptxas`` for ``sm_<arch>`` (bf16 operands, K = V = 128, chunk 64) and
reads the resource usage with the bundled ``cuobjdump``. Triton on the GPU machine may be a
different version; read the numbers as a guide, then time the candidates there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The kernels must compile, not run in the interpreter (chosen when the module is imported).
os.environ["TRITON_INTERPRET"] = "0"

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3verify.kda import kernels

FP32 = {"g", "G", "GL", "h0", "hT", "pool"}
INT64 = {"chunk_start", "chunk_end", "cu", "seq_chunks", "indices"}
SCALARS = {"scale": "fp32", "anchor_offset": "fp32", "H": "i32", "T": "i32"}
SHAPE = dict(K=128, V=128, BK=128, C=64, BC=16, ANCHOR=0, IEEE=False, HAS_H0=False, STORE_HT=False)


def signature(fn: triton.JITFunction) -> dict[str, str]:
    """Argument types by name: fp32 gates and states, int64 tables, bf16 everything else."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in SCALARS:
            sig[p.name] = SCALARS[p.name]
        else:
            sig[p.name] = "*fp32" if p.name in FP32 else "*i64" if p.name in INT64 else "*bf16"
    return sig


def usage(fn: triton.JITFunction, constants: dict, arch: int, warps: int, stages: int) -> str:
    """``REG``/``STACK`` of one compiled kernel and its shared memory, or the compile error."""
    names = {p.name for p in fn.params if p.is_constexpr}
    src = ASTSource(fn=fn, signature=signature(fn), constexprs={k: v for k, v in constants.items() if k in names})
    try:
        options = dict(num_warps=warps, num_stages=stages)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # report any compiler failure and go on
        return f"compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (f"{regs.group(1) if regs else '?'} registers, {stack.group(1) if stack else '?'} B stack (spills), "
            f"{compiled.metadata.shared} B shared")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    launches = [
        ("intra", kernels._intra_kernel, dict(SHAPE, BV=128), 3),
        *[
            (f"state block_v={bv} stages={st}", kernels._state_kernel, dict(SHAPE, BV=bv, STAGES=st), st)
            for bv in (32, 64)
            for st in (2, 3)
        ],
        *[(f"output block_v={bv}", kernels._output_kernel, dict(SHAPE, BV=bv), 3) for bv in (64, 128)],
        ("decode block_v=64", kernels._recurrent_kernel, dict(SHAPE, BV=64), 3),
    ]
    print(f"Triton {triton.__version__}, sm_{args.arch}, bf16, K = V = 128, chunk 64")
    for name, fn, constants, stages in launches:
        for warps in args.warps:
            print(f"{name:28s} {warps} warps: {usage(fn, constants, args.arch, warps, stages)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
