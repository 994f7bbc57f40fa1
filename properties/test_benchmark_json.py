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


def test_experiment_options_are_read_as_written(gpu_timing) -> None:
    """Structural: an experiment's ``key=value`` is a Python literal where it is one, else the
    word itself (an empty one included); a bare key is ``True``."""
    assert gpu_timing.option("chains=3") == ("chains", 3)
    assert gpu_timing.option("gather=False") == ("gather", False)
    assert gpu_timing.option("store=.cs") == ("store", ".cs")
    assert gpu_timing.option("store=evict_first") == ("store", "evict_first")
    assert gpu_timing.option("store=") == ("store", "")
    assert gpu_timing.option("own") == ("own", True)


def test_experiment_variants_name_unknown_options(gpu_timing) -> None:
    """Structural: a variant's overrides come back as written, the defaults fill the rest, and a
    key that is not an option is refused with the known ones named."""
    defaults = {"lag": 8, "store": ".cs"}
    assert gpu_timing.variant_options("lag=4,store=", defaults) == {"lag": 4, "store": ""}
    assert gpu_timing.with_defaults(defaults, {"lag": 4}) == {"lag": 4, "store": ".cs"}
    with pytest.raises(KeyError, match=r"unknown options \['lga'\]; known: \['lag', 'store'\]"):
        gpu_timing.variant_options("lga=4", defaults)


def test_named_variants_take_overrides_and_name_unknown_keys(gpu_timing) -> None:
    """Structural: a variant's name brings its options, ``key=value`` overrides them, a text
    without a known name is overrides alone, and an unknown key (a misspelt name too) is
    refused with the known options named; the command line names the variants as well."""
    import argparse

    named = {"pack14": {"slabs": 14, "pack": True}}
    defaults = {"slabs": 16, "pack": False, "ring": 4}
    assert gpu_timing.named_variant("pack14", named, defaults) == {"slabs": 14, "pack": True}
    assert gpu_timing.named_variant("pack14,ring=3", named, defaults) == {"slabs": 14, "pack": True, "ring": 3}
    assert gpu_timing.named_variant("ring=2", named, defaults) == {"ring": 2}
    with pytest.raises(KeyError, match=r"unknown options \['rnig'\]; known: \['pack', 'ring', 'slabs'\]"):
        gpu_timing.named_variant("pack14,rnig=3", named, defaults)
    with pytest.raises(KeyError, match=r"unknown options \['pak14'\]"):
        gpu_timing.named_variant("pak14", named, defaults)
    parser = argparse.ArgumentParser()
    errors: list[str] = []
    parser.error = lambda message: errors.append(message)  # type: ignore[method-assign]
    gpu_timing.chosen_variants(parser, ["pak14"], defaults, named)
    assert errors and "'pak14'" in errors[0] and "(variants: pack14)" in errors[0]


def test_a_variant_row_reports_agreement_repeats_and_errors(gpu_timing, monkeypatch: pytest.MonkeyPatch) -> None:
    """Structural: a variant's row holds its agreement with the reference, whether a second
    call gave the same bits and its time against the copy bandwidth; a variant that raises is
    a row with its error (``do_bench`` and the device synchronisation are replaced, so this
    runs without a GPU)."""
    import torch

    from k3verify.attnres.chunkwise import Stats

    monkeypatch.setattr(gpu_timing, "do_bench", lambda fn, **kw: [2.0, 1.0, 3.0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ref = Stats(torch.zeros(2, 4), torch.ones(2, 4), torch.ones(2, 4, 8))
    calls = []

    def drifting() -> Stats:  # m off by 0.5; N differs between the two calls
        calls.append(1)
        return Stats(ref.m + 0.5, ref.Z.clone(), ref.N * (1 + len(calls) * 1e-3))

    lines: list[str] = []
    row = gpu_timing.variant_row("v", drifting, ref, 4e9, 4.0, "g", lines.append, 8, options={"a": 1})
    assert row["agreement"]["m"] == 0.5 and row["agreement"]["Z"] == 0.0
    assert row["repeatable"] is False and row["options"] == {"a": 1}
    assert row["ms"] == 2.0 and row["fraction_of_copy"] == pytest.approx(4e9 / 2e-3 / 1e12 / 4.0)

    def broken() -> Stats:
        raise ValueError("no such shape")

    row = gpu_timing.variant_row("w", broken, ref, 4e9, 4.0, "g", lines.append, 8)
    assert row == {"variant": "w", "error": "ValueError: no such shape"} and "no such shape" in lines[-1]
