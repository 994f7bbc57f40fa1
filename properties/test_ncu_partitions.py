"""``benchmarks/ncu_partitions.py``: Nsight Compute's source page split into a warp-specialised
kernel's partitions at its ``setmaxnreg`` instructions. Rule: structural (a small source page
written here, whose samples per partition are known by construction)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
          "stall_long_sb", "stall_barrier (Not Issued)"]  # fmt: skip


@pytest.fixture
def ncu_partitions(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ncu_partitions

    return ncu_partitions


def _page(path: Path, rows: list[list[str]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "_ws_kernel"])
        writer.writerow(HEADER)
        writer.writerows(rows)
    return path


def test_samples_are_split_at_setmaxnreg(ncu_partitions, tmp_path: Path) -> None:
    rows = [
        ["0x0", "LDC R1, c[0x0][0x28]", "1", "10", "0", "1", "0"],
        ["0x10", "USETMAXREG.DEALLOC.CTAPOOL 0x18", "0", "4", "0", "0", "0"],
        ["0x20", "@!P0  BRA 0x100", "300", "1,000", "0", "300", "0"],
        ["0x30", "UTMALDG.2D [UR4], [UR6]", "20", "50", "0", "20", "0"],
        ["0x40", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x98", "0", "4", "0", "0", "0"],
        ["0x50", "HMMA.16816.F32.BF16 R4, R8, R12, R4", "600", "2,000", "150", "450", "0"],
        ["0x60", "BAR.SYNC.DEFER_BLOCKING 0x1", "79", "8", "79", "0", "0"],
    ]
    header, data, spans = ncu_partitions.partitions(str(_page(tmp_path / "page.csv", rows)))
    assert header == HEADER and len(data) == 7
    assert spans == [(0, 1), (1, 4), (4, 7)]
    text = ncu_partitions.report(str(tmp_path / "page.csv"), top=1)
    lines = text.splitlines()
    assert lines[0].endswith("1000 samples, 7 instructions")
    # The first part holds 0.1% of the samples, below the 0.5% shown; the others in order.
    loader, mma = [line for line in lines if line.startswith("[")]
    assert loader.startswith("[1:4] 32.0% of samples, 1.05e+03 instructions; BRA 1e+03, UTMALDG 50")
    assert mma.startswith("[4:7] 67.9% of samples")
    stalls = [line for line in lines if line.strip().startswith("stalls:")]
    assert stalls[1].strip() == "stalls: long_sb 66%, barrier 34%"
    assert "HMMA.16816.F32.BF16 R4, R8, R12, R4  long_sb" in text
