"""The offline compile report (``benchmarks/kernel_compile.py``, ``benchmarks/kda_compile.py``):
every launch of a module compiles for sm_90 without a GPU and reports its registers.

Rule: none (a tool check); a kernel that stops compiling, or a launch the report leaves out,
fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import moe_gpu  # noqa: E402  (the launch shapes its sweep times, each compiled by the report)

from k3verify.mla import kernels as mla_kernels  # noqa: E402

# MLA: every decode shape the benchmark sweeps at a bf16 and an fp8 cache, and the bf16 and fp32
# prefill. MoE: the router's selection, the tile table, the combine, and every swept shape of the
# logits, up and down launches.
LAUNCHES = {"attnres": 3, "kda": 13, "mla": 2 * len(mla_kernels.DECODE_SHAPES) + 2,
            "moe": 3 + sum(len(moe_gpu.CANDIDATES[launch]) for launch in ("logits", "up", "down"))}  # fmt: skip


def _report(*args: str) -> list[str]:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
    done = subprocess.run([sys.executable, *args, "--warps", "4"], capture_output=True, text=True, env=env,
                          timeout=900, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "warps:" in line]


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(LAUNCHES))
def test_compile_report_covers_every_launch(module: str) -> None:
    lines = _report(str(ROOT / "benchmarks" / "kernel_compile.py"), "--module", module)
    assert len(lines) == LAUNCHES[module] and all("registers" in line for line in lines), lines


@pytest.mark.slow
def test_kda_compile_is_the_kda_report() -> None:
    lines = _report(str(ROOT / "benchmarks" / "kda_compile.py"))
    assert len(lines) == LAUNCHES["kda"] and all("registers" in line for line in lines), lines


@pytest.mark.slow
def test_kda_state_pass_prefetches_every_load() -> None:
    """The state pass runs its chunks in sequence: a load left synchronous in its loop adds the
    memory latency to every step (a masked load of a partial chunk's columns did, on an H200)."""
    lines = [line for line in _report(str(ROOT / "benchmarks" / "kda_compile.py")) if line.startswith("state")]
    assert lines and all(" 0 loads waited on in loops" in line for line in lines), lines


def test_waited_loads_count_tiles_and_single_values_apart() -> None:
    """The synchronous loads inside a loop body, loads of tensors and of one value counted apart;
    none before a loop or after its yield. In a subprocess: importing the report switches the
    interpreter off for the modules imported after it."""
    ttgir = "\n".join([
        "%a = tt.load %p0 : tensor<64x!tt.ptr<bf16>, #blocked>",
        "scf.for %i = %c0 to %n step %c1 iter_args(%x = %a) -> (tensor<64xbf16>) {",
        "  %b = tt.load %p1 : tensor<64x128x!tt.ptr<bf16>, #blocked>",
        "  %c = tt.load %p2 : !tt.ptr<i32>",
        "  %d = ttg.async_copy_global_to_local %p3, %buf : tensor<64x!tt.ptr<bf16>, #blocked>",
        "  %e = tt.load %p4 masked : tensor<16x!tt.ptr<fp32>, #blocked1>",
        "  scf.yield %x : tensor<64xbf16>",
        "}",
        "%f = tt.load %p5 : !tt.ptr<i32>",
    ])  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
    done = subprocess.run([sys.executable, "-c", "import sys, kernel_compile; "
                           "print(kernel_compile.waited_loads(sys.stdin.read()))"], input=ttgir, capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(2, 1)", done.stdout
