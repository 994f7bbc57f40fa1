"""The GPU benchmark's timings in pytest-benchmark's JSON shape: ``pytest-benchmark compare``
reads them like the CPU benchmarks' saved runs. Rule: structural (``do_bench`` is replaced by
fixed repetitions, so this runs without a GPU)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_timing(monkeypatch: pytest.MonkeyPatch):
    """The timing module every GPU benchmark (KDA, AttnRes) records its repetitions through."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_timing

    return gpu_timing


def test_gpu_timings_compare_with_pytest_benchmark(gpu_timing, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:  # fmt: skip
    import benchmark_json

    files = []
    for run, times in enumerate(([2.0, 1.0, 3.0, 2.5], [1.0, 0.5, 1.5, 1.2])):
        monkeypatch.setattr(gpu_timing, "do_bench", lambda fn, t=times, **kw: list(t))
        gpu_timing.SAMPLES.clear()
        assert gpu_timing.ms(lambda: None, "prefill {'T': 8192}", "ours", block_v=32) == statistics.median(times)
        gpu_timing.ms(lambda: None, "prefill {'T': 8192}", "fla-core")
        doc = benchmark_json.document(gpu_timing.SAMPLES, device="test device", commit="0" * 40, dirty=False)
        (bench,) = [b for b in doc["benchmarks"] if b["name"].startswith("ours")]
        assert bench["stats"]["rounds"] == 4 and bench["stats"]["min"] == min(times) / 1e3
        assert bench["params"] == {"block_v": 32}
        files.append(tmp_path / f"000{run + 1}_run.json")
        files[-1].write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, "-m", "pytest_benchmark", "compare", "--columns=min,median,max",
                           *map(str, files)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ours[block_v=32]" in done.stdout and "fla-core" in done.stdout, done.stdout

