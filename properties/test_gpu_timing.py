"""How the GPU benchmarks find where the device waits on the host (``gpu_timing.gap_report``, fed
by the torch profiler on a GPU through ``gpu_timing.spans``). Rule: structural, against the
definition written as a loop over whole microseconds: a microsecond of the call is busy when some
device interval covers it; the events that are not the call's work are named and left out."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import DeviceType

intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)).map(lambda p: (p[0], p[0] + p[1])),
                     min_size=1, max_size=12)  # fmt: skip
ranges = st.lists(st.tuples(st.sampled_from(["moe.checks", "moe.experts", "aten::sort"]), st.integers(0, 60),
                            st.integers(1, 40)).map(lambda r: (r[0], r[1], r[1] + r[2])), max_size=6)  # fmt: skip


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_timing  # noqa: E402


@given(device=intervals, host=ranges)
def test_busy_and_idle_time_are_the_covered_and_uncovered_microseconds(device, host) -> None:
    got = gpu_timing.gap_report(device, host, top=100)
    first = min([a for a, _ in device] + [a for _, a, _ in host])
    last = max(b for _, b in device)
    covered = [any(a <= t < b for a, b in device) for t in range(first, last)]
    assert got["busy_ms"] * 1e3 == pytest.approx(sum(covered))
    assert got["idle_ms"] * 1e3 == pytest.approx(len(covered) - sum(covered))
    assert got["span_ms"] * 1e3 == pytest.approx(last - first)
    # every gap is a run of uncovered microseconds, longest first
    lengths = [g["ms"] for g in got["gaps"]]
    assert lengths == sorted(lengths, reverse=True) and sum(lengths) == pytest.approx(got["idle_ms"])
    for g in got["gaps"]:
        start = first + round(g["at_ms"] * 1e3)
        assert not any(covered[start - first : start - first + round(g["ms"] * 1e3)])


def test_a_gap_is_named_by_the_innermost_range_covering_half_of_it_or_more() -> None:
    device = [(0, 10), (30, 40), (50, 60), (80, 90)]
    host = [("moe.layer", 0, 90), ("moe.experts", 12, 28), ("aten::empty", 14, 15), ("moe.output", 45, 52)]
    got = gpu_timing.gap_report(device, host, top=3)
    named = [(round(g["at_ms"] * 1e3), round(g["ms"] * 1e3), g["host"]) for g in got["gaps"]]
    assert named == [(10, 20, "moe.experts"), (60, 20, "moe.layer"), (40, 10, "moe.output")]
    alone = gpu_timing.gap_report([(0, 5), (9, 12)], [], top=1)
    assert alone["gaps"] == [dict(at_ms=pytest.approx(5e-3), ms=pytest.approx(4e-3), host="(python)")]


def _event(name: str, device: DeviceType, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
    """One profiler event as ``gpu_timing.spans`` reads it."""
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))  # fmt: skip


def test_spans_keep_the_calls_work_and_leave_out_annotations_and_what_ran_before() -> None:
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event("Activity Buffer Request", cpu, 0, 2000),  # the profiler's own, before the call
        _event("_up_kernel", cuda, 1500, 1900),  # a warm-up call's
        _event(gpu_timing.CALL, cpu, 2100, 2400),
        _event("moe.experts", cpu, 2150, 2300, annotation=True),
        _event("moe.experts", cuda, 2200, 2390, annotation=True),  # spans the gap below
        _event("_up_kernel", cuda, 2200, 2250),
        _event("_down_kernel", cuda, 2350, 2390),
        _event("cudaDeviceSynchronize", cpu, 2400, 2450),
    ]
    device, host = gpu_timing.spans(events)
    assert device == [(2200, 2250), (2350, 2390)]
    assert host == [("moe.experts", 2150, 2300)]
    got = gpu_timing.gap_report(device, host, top=2)
    assert got["idle_ms"] * 1e3 == pytest.approx(50 + 100)  # before the first kernel, between the two
    with pytest.raises(ValueError, match=r"expected one 'k3verify\.call' range"):
        gpu_timing.spans([e for e in events if e.name != gpu_timing.CALL])
