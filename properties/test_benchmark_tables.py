"""The GPU benchmarks' Markdown tables, built on the CPU from rows of every kind a run writes
(ours, a peer that ran, a peer that was refused or ran out of memory, the launch-shape sweep).

Rule: structural. A table that cannot be built loses the run's JSON too (it is written with
it): every kind of row must render, with the figures and the errors it holds. Free text (a
device, an implementation, another library's error, a profiler's kernel name) is escaped: a
``|`` or a tag in it neither ends the row nor becomes markup.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attnres_gpu
import kda_gpu
import mla_gpu
import moe_gpu

ENV = {"git_commit": "abc"}
HOSTILE = "x | <script>alert(1)</script> *y*"


def _escaped(table: str, rows: int) -> None:
    """The hostile text appears only escaped, and every table row kept its own cells."""
    assert "<script>" not in table and "x \\| &lt;script&gt;" in table and "\\*y\\*" in table
    assert sum(line.startswith("|") for line in table.splitlines()) >= rows


def test_the_mla_table_renders_ours_a_peer_and_a_refused_peer() -> None:
    base = dict(kind="decode", B=64, context=4096, heads=96, cache="bf16")
    rows = [
        base | dict(implementation="k3verify", ms=0.42, num_splits=4, heads_per_program=32, fraction_of_copy=0.25),
        base | dict(implementation="k3verify", ms=0.31, num_splits=2, launch="64 heads x 32 keys w8 s2",
                    default_launch_ms=0.4, fraction_of_copy=0.33),
        base | dict(implementation="flex_attention", ms=17.9, kernel_options={"BLOCK_M": 16},
                    ratio_peer_over_ours=42.7),
        base | dict(implementation="flex_attention", error="OutOfMemoryError: <script>"),
        dict(kind="prefill", T=8192, heads=12, implementation="k3verify", ms=0.52, tflops=495.0),
        dict(kind="prefill", T=8192, heads=12, implementation="sdpa flash", error="RuntimeError: No available kernel."),
    ]  # fmt: skip
    table = mla_gpu.markdown(dict(device="H100", copy_tbps=3.04, rows=rows, environment=ENV))
    assert "splits 4, 32 heads a program" in table and "42.70x" in table
    assert "splits 2, 64 heads x 32 keys w8 s2; the default shape 0.4000 ms" in table
    assert "kernel\\_options {'BLOCK\\_M': 16}" in table and "OutOfMemoryError" in table
    assert "No available kernel." in table and "495" in table
    hostile = [dict(r, implementation=HOSTILE) | {k: HOSTILE for k in ("error", "launch") if k in r} for r in rows]
    _escaped(mla_gpu.markdown(dict(device=HOSTILE, copy_tbps=3.04, rows=hostile, environment=ENV)), len(rows))


def test_the_moe_table_renders_the_sweep_the_peer_and_the_layer() -> None:
    rows = [
        dict(kind="experts", T=4096, H=384, implementation="k3verify", tiles="a / b", ms=4.4, tflops=122.0,
             fraction_of_peak=0.15),
        dict(kind="experts", T=4096, H=384, implementation="torch._grouped_mm + SiTU", ms=6.6, tflops=81.0,
             ratio_peer_over_ours=1.5),
        dict(kind="experts", T=4096, H=3072, implementation="torch._grouped_mm + SiTU", error="OutOfMemoryError"),
        dict(kind="layer", T=4096, H=384, part="combine", ms=0.34),
        dict(kind="layer", T=4096, H=384, part="layer", error="OutOfMemoryError: 9 GiB"),
        dict(kind="layer", T=4096, H=384, part="layer, production dtype / sum of the GEMMs", ratio=1.48),
        dict(kind="split", T=4096, H=384, kernel="_up_kernel", ms=1.25),
        dict(kind="gap", T=4096, H=384, host="(the whole call)", at_ms=0.0, ms=1.02, span_ms=5.1, busy_ms=4.08),
        dict(kind="gap", T=4096, H=384, host="moe.experts", at_ms=1.7, ms=0.31),
        dict(kind="gap", T=4096, H=384, host="(profiler)", error="RuntimeError: no device activity"),
        dict(kind="tiles", T=4096, H=384, launch="up", tiles="64x64x64 w4 s3", ms=2.29, difference=0.0),
        dict(kind="tiles", T=4096, H=384, launch="down", tiles="128x256x64 w8 s3", error="differs by 1e-1"),
        dict(kind="padding", T=4096, H=384, tile_rows=64, rows=65536, computed_rows=104704, real_fraction=0.6259),
    ]  # fmt: skip
    table = moe_gpu.markdown(dict(device="H100", peak_tflops=793.0, rows=rows, environment=ENV))
    assert "| 4096 | 384 | k3verify | 4.400 | 122 | 15% |" in table and "1.50x" in table
    assert "OutOfMemoryError: 9 GiB" in table and "| 1.48x |" in table
    assert "| up | 64x64x64 w4 s3 | 2.290 | 0.0e+00 |" in table and "differs by 1e-1" in table
    assert "| 4096 | 384 | \\_up\\_kernel | 1.250 |" in table
    assert "| 4096 | 384 | 1.700 | 0.310 | moe.experts |" in table and "no device activity" in table
    assert "| 4096 | 384 | 64 | 65536 | 104704 | 62.6% |" in table
    text = ("implementation", "error", "part", "kernel", "tiles", "host")
    hostile = [{k: (HOSTILE if k in text else v) for k, v in r.items()} for r in rows]
    _escaped(moe_gpu.markdown(dict(device=HOSTILE, peak_tflops=793.0, rows=hostile, environment=ENV)), len(rows))


def test_the_kda_and_attnres_tables_escape_their_free_text() -> None:
    kda = [dict(kind="prefill", T=8192, H=96, ours_ms=2.7, best_ms=2.6, best_config=HOSTILE, peer=HOSTILE,
                peer_ms=3.5, ratio=1.28, ratio_best=1.3),
           dict(kind="split", T=8192, H=96, implementation=HOSTILE, launches={HOSTILE: 0.5}),
           dict(kind="accuracy", implementation=HOSTILE, rms_ratio=5e-3, baseline_rms_ratio=4.4e-3)]  # fmt: skip
    _escaped(kda_gpu.markdown(dict(device=HOSTILE, copy_tbps=3.0, rows=kda, environment=ENV)), 3)
    attnres = [dict(kind="phase", T=4096, d=7168, implementation=HOSTILE, error=HOSTILE),
               dict(kind="phase", T=4096, d=7168, implementation=HOSTILE, ms=2.0),
               dict(kind="accuracy", logit_scale=1.0, implementation=HOSTILE, rms_ratio=3e-3,
                    baseline_rms_ratio=3e-3)]  # fmt: skip
    _escaped(attnres_gpu.markdown(dict(device=HOSTILE, copy_tbps=3.0, rows=attnres, environment=ENV)), 3)


def test_the_moe_padding_rows_count_each_experts_short_last_tile() -> None:
    """Structural, against counts done by hand: experts of 100, 0 and 192 rows take 2 + 0 + 3
    tiles of 64 rows (320 computed) and 1 + 0 + 2 of 128 (384); 292 rows are real."""
    import torch

    said: list[str] = []
    rows = moe_gpu.padding_rows(16, 384, torch.tensor([0, 100, 100, 292], dtype=torch.int32), said.append)
    assert [(r["tile_rows"], r["rows"], r["computed_rows"]) for r in rows] == [(64, 292, 320), (128, 292, 384)]
    assert rows[0]["real_fraction"] == 292 / 320 and "0-192 rows an expert" in said[0]
