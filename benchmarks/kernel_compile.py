"""Compile the Triton kernels of a module for a GPU target without a GPU: registers, spills,
shared memory, and the loads inside loops that are not prefetched.

    python benchmarks/kernel_compile.py --module attnres|kda|mla|moe [--arch 90] [--warps 2 4 8]

Device time is scarce; this shows on any machine whether a launch configuration spills, or
needs more shared memory than an SM has, before it is timed (a spilling kernel is rarely the
fast one). It compiles with the installed Triton and its bundled ``ptxas`` for ``sm_<arch>`` at
K3's shapes (bf16 operands) and reads the resource usage with the bundled ``cuobjdump``. Every
pointer is taken as 16-byte aligned and the integers named below as multiples of 16, as Triton's
launcher specialises them on the GPU (without that the loads are neither vectorised nor
pipelined, and the figures are not the GPU's). "Loads waited on in loops" counts the loads
that Triton's pipeliner left synchronous inside a loop body (a mask along a tile's contiguous
dimension is one cause): each one stalls every iteration on memory latency, which in a
sequential loop such as KDA's state pass is the loop's own time; loads of a single value (a
table's entry) are counted apart. Triton on the GPU machine may
be a different version (``nox -s kernel-compile`` compiles every module with that version); read
the numbers as a guide, then time the candidates there. Exit status 1 when a launch does not compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The kernels must compile, not run in the interpreter (chosen when the modules are imported).
os.environ["TRITON_INTERPRET"] = "0"

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@dataclass(frozen=True)
class Launch:
    """One launch configuration: the kernel, its constexprs, stages; argument types by name
    (``*bf16`` when not named) and the integer arguments that are multiples of 16."""

    name: str
    fn: Any
    constants: dict[str, Any]
    stages: int
    types: dict[str, str] = field(default_factory=dict)
    divisible: frozenset[str] = frozenset()
    warps: int | None = None  # the launch's own; None: each of --warps


def usage(launch: Launch, arch: int, warps: int, maxnreg: int | None = None) -> str:
    """``REG``/``STACK`` of one compiled kernel and its shared memory, or the compile error."""
    fn = launch.fn
    sig = {p.name: "constexpr" if p.is_constexpr else launch.types.get(p.name, "*bf16") for p in fn.params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
               if sig[p.name].startswith("*") or p.name in launch.divisible}  # fmt: skip
    constexprs = {k: v for k, v in launch.constants.items() if sig.get(k) == "constexpr"}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned),
                                  target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=warps, num_stages=launch.stages,
                                               **({"maxnreg": maxnreg} if maxnreg else {})))  # fmt: skip
    except Exception as exc:  # report any compiler failure and go on
        return f"compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    regs, stack = resource_usage(compiled.asm["cubin"])
    tiles, scalars = waited_loads(compiled.asm["ttgir"])
    return (f"{regs} registers, {stack} B stack (spills), "
            f"{compiled.metadata.shared} B shared, {tiles} loads waited on in loops"
            + (f" (and {scalars} scalar)" if scalars else ""))  # fmt: skip


def resource_usage(cubin: bytes) -> tuple[str, str]:
    """Registers and spill stack bytes of a compiled kernel (``'?'`` where not reported), read from
    its cubin with the ``cuobjdump`` that Triton bundles."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (regs.group(1) if regs else "?"), (stack.group(1) if stack else "?")


def waited_loads(ttgir: str) -> tuple[int, int]:
    """Synchronous ``tt.load`` operations inside ``scf.for`` bodies of a kernel's TTGIR (the
    pipeliner turns the ones it prefetches into asynchronous copies): ``(tiles, scalars)``, the
    loads of tensors and those of one value (a table entry read once per tile, as a persistent
    launch reads its next tile's: a short wait, not a tile's latency every step)."""
    loads = [line for body in ttgir.split("scf.for")[1:] for line in body.split("scf.yield")[0].splitlines()
             if re.search(r"= tt\.load ", line)]  # fmt: skip
    scalars = sum(": tensor<" not in line for line in loads)
    return len(loads) - scalars, scalars


def kda_launches() -> list[Launch]:
    """KDA at K = V = 128, chunk 64: the prefix, block, state, output and decode launches."""
    from k3verify.kda import kernels

    types = {n: "*fp32" for n in ("g", "G", "GL", "h0", "hT", "pool")}
    types |= {n: "*i64" for n in ("chunk_start", "chunk_end", "cu", "seq_chunks", "indices")}
    types |= {"scale": "fp32", "anchor_offset": "fp32", "H": "i32", "T": "i32"}
    shape = dict(K=128, V=128, BK=128, C=64, BC=16, ANCHOR=0, IEEE=False, HAS_H0=False, STORE_HT=False)
    div = frozenset({"T"})  # T = 8192, 32768 at the benchmark shapes

    def launch(name: str, fn: Any, stages: int, **extra: Any) -> Launch:
        return Launch(name, fn, shape | extra, stages, types, div)

    return [
        *[launch(f"prefix block_k={bk}", kernels._prefix_kernel, 3, BK=bk) for bk in (32, 64)],
        *[launch(f"blocks {'A_qk' if qk else 'A_kk, W, U'} block_k={bk}", kernels._blocks_kernel, 3, BK=bk, BV=32,
                 QK=qk) for qk in (True, False) for bk in (16, 32)],
        *[launch(f"state block_v={bv} stages={st}", kernels._state_kernel, st, BV=bv, STAGES=st)
          for bv in (16, 64) for st in (2, 3)],
        *[launch(f"output block_v={bv}", kernels._output_kernel, 3, BV=bv) for bv in (64, 128)],
        launch("decode block_v=64", kernels._recurrent_kernel, 3, BV=64),
    ]


def mla_launches() -> list[Launch]:
    """Gated MLA at K3's widths (R = 512, Dr = 64, Dn = Dv = 128, pages of 64): the decode
    kernel at its launch shape and the prefill kernel at its tiles."""
    import torch

    from k3verify.mla import kernels

    i32, i64 = "i32", "*i64"
    ints = ("T", "H", "R", "Dr", "W", "page_size", "max_pages", "BT", "num_splits", "head_blocks")
    decode = dict(block_table=i64, seq_lens=i64, o_part="*fp32", lse_part="*fp32", scale="fp32",
                  **dict.fromkeys(ints, i32))
    scalars = dict(starts=i64, scale="fp32", **{n: i32 for n in ("T", "H", "L", "Dn", "Dr", "Dv")})

    def prefill(dtype: Any) -> Launch:
        # The tiles the kernel itself picks for operands of this dtype on a GPU.
        bm, bn, stages = kernels._prefill_tiles(dtype)
        ieee = dtype == torch.float32
        operands = dict.fromkeys(("q_n", "q_p", "k_n", "k_p", "v", "o"), "*fp32") if ieee else {}
        return Launch(f"prefill {'fp32 ' if ieee else ''}{bm}x{bn} stages={stages}", kernels._prefill_kernel,
                      dict(BM=bm, BN=bn, BDN=128, BDR=64, BDV=128, GROUP=kernels.PREFILL_GROUP, IEEE=ieee),
                      stages, scalars | operands, frozenset({"T", "L", "Dn", "Dr", "Dv"}))

    def decode_launch(shape: Any, quant: bool) -> Launch:
        # An fp8 cache: its codes are the pool (one byte each) and its per-token scales fp32.
        args = decode | (dict(pool="*fp8e4nv", scales="*fp32") if quant else {})
        return Launch(f"decode {shape}{' fp8' if quant else ''}", kernels._decode_kernel,
                      dict(BH=shape.heads, BC=128, NC=4, BDR=64, BN=shape.keys, QUANT=quant, IEEE=False),
                      shape.stages, args, frozenset({"R", "Dr", "W", "page_size", "max_pages", "BT"}), shape.warps)

    return [
        # The default shape and the ones benchmarks/mla_gpu.py sweeps, at the bf16 and fp8 caches.
        *(decode_launch(shape, quant) for quant in (False, True) for shape in kernels.DECODE_SHAPES),
        prefill(torch.bfloat16),
        prefill(torch.float32),
    ]  # fmt: skip


def moe_launches() -> list[Launch]:
    """Stable LatentMoE at K3's shapes (d = 7168, E = 896, k = 16, latent 3584): the router's two
    launches and the grouped expert launches."""
    from k3verify.moe import kernels

    i32, f32 = "i32", "fp32"
    logits = dict(x="*fp32", w="*fp32", r="*fp32", T=i32, D=i32, E=i32)
    select = dict(r="*fp32", bias="*fp32", idx_out="*i64", wt_out="*fp32", T=i32, E=i32, rho=f32, renorm_eps=f32)
    tables = dict(token="*i32", tile_expert="*i32", tile_row="*i32", offsets="*i32", count="*i32")
    up = tables | dict(Dl=i32, F=i32, beta1=f32, beta2=f32)
    down = tables | dict(weight="*fp32", dest="*i64", F=i32, Dl=i32)  # out: the operand dtype, as the layer stores rows

    def router(t: Any) -> Launch:
        return Launch(f"router logits {t}", kernels._logits_kernel,
                      dict(BT=t.rows, BE=t.cols, BD=t.depth, EXACT=False), t.stages, logits, frozenset({"D"}),
                      t.warps)

    def experts(name: str, fn: Any, t: Any, args: dict[str, str], **extra: Any) -> Launch:
        if t.tma:  # the operands a TMA launch reads through descriptors, with their blocks
            weight = f"tensordesc<bf16[1,{t.depth},{t.cols}]>"
            args = args | (dict(w1=weight, w3=weight) if "w1" in fn.arg_names
                           else dict(h=f"tensordesc<bf16[{t.rows},{t.depth}]>", w2=weight))  # fmt: skip
        return Launch(f"{name} {t}", fn, dict(BM=t.rows, BN=t.cols, BK=t.depth, IEEE=False, DESC=t.tma,
                                              PERSISTENT=t.persistent > 0, **extra),
                      t.stages, args, frozenset({"Dl", "F"}), t.warps)

    return [
        *(router(t) for t in tile_candidates("logits")),
        Launch("router selection", kernels._select_kernel, dict(K=16, KP=16, BT=kernels.SELECT_TOKENS, BE=1024,
                                                                HIGHEST=False), 3, select),
        *(experts("experts up", kernels._up_kernel, t, up, SWIGLU=False) for t in tile_candidates("up")),
        *(experts("experts down", kernels._down_kernel, t, down, SCATTER=True)
          for t in tile_candidates("down")),
        Launch("tile table", kernels._table_kernel, dict(ROWS=128, BE=1024, BT=16), 1,
               dict(offsets="*i32", expert_out="*i32", first_out="*i32", count_out="*i32", E=i32, total=i32,
                    bound=i32), frozenset(), 8),
        Launch("combine and norm", kernels._combine_kernel, dict(K=16, BD=4096), 1,
               dict(rows="*bf16", gain="*fp32", normed="*bf16", Dl=i32, eps=f32), frozenset({"Dl"}), 8),
    ]  # fmt: skip


def tile_candidates(launch: str) -> list[Any]:
    """The shapes ``benchmarks/moe_gpu.py`` times for a MoE launch (``logits``, ``up``, ``down``):
    the default first."""
    sys.path.insert(0, str(Path(__file__).parent))
    import moe_gpu

    return moe_gpu.CANDIDATES[launch]


def attnres_launches() -> list[Launch]:
    """Block AttnRes at K3's shape (d = 7168, 24 queries over 8 stored blocks, bf16 stream): the
    phase-1 logits and accumulate launches and the phase-2 merge."""
    from k3verify.attnres import kernels

    i32, f32 = "i32", "fp32"
    stats = dict(m_out="*fp32", z_out="*fp32", n_out="*fp32")
    logits = dict(sb=i32, st=i32, wg="*fp32", ell="*fp32", ess="*fp64", T=i32, D=i32, n=i32)
    accumulate = dict(sb=i32, st=i32, ell="*fp32", ess="*fp64", T=i32, D=i32, n=i32, Q=i32, eps=f32, **stats)
    merge = dict(m_in="*fp32", z_in="*fp32", n_in="*fp32", wg="*fp32", T=i32, D=i32, eps=f32)
    return [
        Launch("phase1 logits", kernels._logits_kernel, dict(BT=kernels.LOGITS_ROWS // 8, BD=kernels.LOGITS_WIDTH,
                                                             QP=32, NP=8, MODE=1), kernels.LOGITS_STAGES, logits,
               frozenset({"T", "D", "sb", "st"})),
        Launch("phase1 accumulate", kernels._accumulate_kernel, dict(SPLIT=kernels.ACC_SPLIT, BD=kernels.ACC_WIDTH,
                                                                     QP=32, NP=16, MODE=1, STAGES=kernels.ACC_STAGES),
               kernels.ACC_STAGES, accumulate, frozenset({"T", "D", "sb", "st"})),
        Launch("phase2 merge", kernels._merge_kernel, dict(HAS_P=True, BT=kernels.MERGE_TOKENS,
                                                           BD=kernels.MERGE_WIDTH), 1, merge, frozenset({"T", "D"})),
    ]  # fmt: skip


MODULES = {"attnres": attnres_launches, "kda": kda_launches, "mla": mla_launches, "moe": moe_launches}


def main(argv: list[str] | None = None, module: str | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if module is None:
        parser.add_argument("--module", choices=sorted(MODULES), required=True)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    module = module or args.module
    print(f"Triton {triton.__version__}, sm_{args.arch}, {module}, bf16 operands at K3's shapes")
    failed = []
    for launch in MODULES[module]():
        for warps in [launch.warps] if launch.warps else args.warps:
            got = usage(launch, args.arch, warps)
            print(f"{launch.name:40s} {warps} warps: {got}", flush=True)
            if got.startswith("compile failed"):
                failed.append(f"{launch.name} ({warps} warps)")
    if failed:
        print(f"{len(failed)} launches of {module} do not compile with Triton {triton.__version__}: "
              + ", ".join(failed), file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
