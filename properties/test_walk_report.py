"""The "Decoder walk" section of the report pages, from ``decoder_walk.json`` (``k3verify walk``):
a real walk of two layers shows every part of its study document in ``report.md`` and
``report.html`` as it writes them, in what ``--format md`` prints, and again when ``report
render`` reads the file back; whatever values a file holds (null, numbers at a double's limits,
text where numbers belong, lists of any length) are shown as text and cut where a table or a
figure would grow, never stopping the page; a report of another command leaves the file out and
says so; a document over the size bound is named under "Not shown". Injected strings:
``test_injection.py``; the page in a browser: ``test_report_browser.py``.

Rules: structural; the share column is the walk's own quadrature shares (they sum to 100 %).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_fuzz import _small_report

from k3verify.cli import main
from k3verify.harness import decoder_walk, render, report
from k3verify.harness.text import html_text, md_text
from k3verify.harness.walk_page import WALK_FILE

# A study document in the shape decoder_walk.study_document writes (two layers, blocks of two
# sublayer calls), for the tests that edit one.
WALK: dict[str, Any] = {
    "title": "Decoder walk",
    "config": {"hidden": 256, "num_layers": 2, "block_size": 1,
               "sublayers": {"kda": 1, "mla": 1, "dense": 1, "moe": 1, "attnres": 5}},
    "prompt": 4, "decode": 2, "dtype": "bf16",
    "seconds": {"walks": 0.21, "attribution": 0.27, "prefill_decode": 0.18},
    "scenarios": {"prefill_decode": {"evaluations": 24}},
    "fp64": {"forms_vs_definitions": 1.05e-15, "worst_h": 6.2e-16},
    "depth_drift": {
        "sublayers": ["kda", "dense", "mla", "moe"], "block_sublayers": 2,
        "curves": {"tiled bf16": [1.6e-3, 4.4e-3, 4.6e-3, 5.2e-3], "naive bf16": [1.6e-3, 4.3e-3, 4.9e-3, 5.6e-3]},
        "y_curves": {"tiled bf16": [7.6e-3, 7.9e-3, 9.7e-3, 8.9e-3], "naive bf16": [7.2e-3, 7.5e-3, 9.6e-3, 1e-2]},
        "block_growth": {"tiled bf16": [2.7, 1.13], "naive bf16": [2.69, 1.14]},
        "growth_per_block": {"tiled bf16": 1.18, "naive bf16": 1.3},
    },
    "decode_steps": {"positions": [0, 1, 2, 3, 4, 5], "prompt": 4, "served": [3e-3, 4e-3, 5e-3, 4e-3, 6e-3, 7e-3],
                     "baseline": [3e-3, 3e-3, 4e-3, 5e-3, 5e-3, 6e-3]},
    "attribution": [
        {"module": "kda", "label": "fp64 chunkwise, kda as tiled bf16", "out_err": 4e-3, "share": 0.64},
        {"module": "moe", "label": "fp64 chunkwise, moe as tiled bf16", "out_err": 3e-3, "share": 0.36},
        {"module": "all", "label": "tiled bf16", "out_err": 5e-3, "share": None},
        {"module": "mla fp8 cache", "label": "fp64 chunkwise, mla as tiled bf16, fp8 e4m3 latent cache",
         "out_err": 6e-3, "share": None},
    ],
    "routing_flips": {"label": "tiled bf16", "fraction": 0.25, "out_err": 0.11},
    "first_divergence": {"planted": {"layer": 1, "module": "moe"}, "found": True, "sublayer": 3, "layer": 1,
                         "module": "moe", "evaluations": 14,
                         "description": "first divergence at sublayer 3: layer 1 channel mixer (moe)"},
}
IMAGE = re.compile(r'src="data:image/png;base64,[A-Za-z0-9+/=]+"')


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``k3verify walk`` at two layers, every job, a bug planted in layer 1's MoE (about 3 s)."""
    out = tmp_path_factory.mktemp("walk") / "w"
    assert main(["walk", "--layers", "2", "--prompt", "8", "--decode", "1", "--workers", "1", "--plant", "1:moe",
                 "--quiet", "--out", str(out)]) == 0
    return out


def md_section(text: str) -> str:
    """The Decoder walk section of a ``report.md``."""
    start = text.index("## Decoder walk")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def html_section(page: str) -> str:
    """The Decoder walk section of a ``report.html``."""
    return page[page.index("<section id='decoder-walk'>"):page.index("</section>") + len("</section>")]


def _md_rows(section: str, heading: str) -> list[list[str]]:
    """The body cells of the first table under ``### heading``."""
    part = section.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0]
    lines = [line for line in part.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[1:]]


def test_a_walk_shows_every_part_of_its_study_document(walked: Path) -> None:
    doc = json.loads((walked / WALK_FILE).read_text())
    md = md_section((walked / "report.md").read_text())
    for heading in ("fp64 agreement", "Depth drift", "Decode steps", "Attribution", "Routing flips",
                    "First divergence", "Job times"):
        assert f"### {heading}\n" in md, heading
    assert "2 layers (hidden 256), a prompt of 8 tokens then 1 decode step, low precision bf16" in md
    assert f"normwise relative max error {report.fmt(doc['fp64']['forms_vs_definitions'])}" in md
    # Depth drift: one row per plan; two layers are one block, so no growth per block (null in the file).
    growth = {r[0]: r for r in _md_rows(md, "Depth drift")}
    assert set(growth) == {"tiled bf16", "naive bf16"} and growth["tiled bf16"][1] == "-"
    curve = doc["depth_drift"]["curves"]["tiled bf16"]
    assert growth["tiled bf16"][2:] == [report.fmt(curve[-1]),
                                        f"{doc['depth_drift']['block_growth']['tiled bf16'][0]:.3f}"]
    served, baseline = _md_rows(md, "Decode steps")
    steps = doc["decode_steps"]
    assert served[1:] == [report.fmt(max(steps["served"][:8])), report.fmt(steps["served"][8]),
                          report.fmt(steps["served"][-1])]
    assert baseline[0].startswith("baseline")
    # Attribution: one row per module type, all, the fp8 cache; the shares sum to 100 %.
    attribution = _md_rows(md, "Attribution")
    assert [r[0] for r in attribution] == ["kda", "mla", "dense", "moe", "attnres", "all", "mla fp8 cache"]
    shares = [float(r[3].removesuffix(" %")) for r in attribution[:5]]
    assert abs(sum(shares) - 100) < 0.3 and [r[3] for r in attribution[5:]] == ["-", "-"], attribution
    assert attribution[0][2] == report.fmt(doc["attribution"][0]["out_err"])
    ((label, flips, _),) = _md_rows(md, "Routing flips")
    assert label == "tiled bf16" and flips == f"{100 * doc['routing_flips']['fraction']:.1f} %"
    divergence = dict(_md_rows(md, "First divergence"))
    assert divergence["planted"] == "layer 1 moe" and divergence["found"] == "yes"
    assert divergence["where"] == "sublayer call 3: layer 1 moe"
    assert [r[0] for r in _md_rows(md, "Job times")] == [md_text(j) for j in decoder_walk.JOBS]
    # The page: the same tables, and the two figures.
    page = html_section((walked / "report.html").read_text())
    assert page.count("<table>") == 6 and len(IMAGE.findall(page)) == 2
    for cell in ("tiled bf16", *(r[3] for r in attribution), doc["first_divergence"]["description"]):
        assert f"<td>{html_text(cell)}</td>" in page, cell


def test_report_render_reads_the_walk_back(walked: Path, tmp_path: Path) -> None:
    """The file beside the report gives the pages the section the run wrote from memory."""
    folder = shutil.copytree(walked, tmp_path / "copy")
    assert main(["report", "render", str(folder), "--maps", str(tmp_path)]) == 0
    for name, section in (("report.md", md_section), ("report.html", html_section)):
        before, after = (section((d / name).read_text()) for d in (walked, folder))
        assert IMAGE.sub("", after) == IMAGE.sub("", before), name


def test_format_md_prints_the_walk(walked: Path) -> None:
    """What ``walk --format md`` prints holds the section ``report.md`` holds."""
    doc = report.load(walked)
    printed = render.report_markdown(doc, {WALK_FILE: json.loads((walked / WALK_FILE).read_text())})
    assert md_section(printed) == md_section((walked / "report.md").read_text())


def _everywhere(doc: Any, value: Any) -> Any:
    """``doc`` with every number replaced by ``value``."""
    if isinstance(doc, dict):
        return {k: _everywhere(v, value) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_everywhere(v, value) for v in doc]
    return value if isinstance(doc, (int, float)) and not isinstance(doc, bool) else doc


def _long() -> dict[str, Any]:
    doc = copy.deepcopy(WALK)
    doc["depth_drift"]["curves"] = {f"plan {i}": [1e-3 * (1 + j % 7) for j in range(9_000)] for i in range(20)}
    doc["depth_drift"] |= {"block_growth": {"plan 0": [1.1] * 500}, "growth_per_block": {}}
    doc["depth_drift"]["sublayers"] = ["kda", "moe"] * 10_000
    doc["decode_steps"] |= {"positions": list(range(50_000)), "served": [1e-3] * 50_000, "baseline": [2e-3] * 50_000}
    doc["attribution"] = [WALK["attribution"][0]] * 1000
    doc["seconds"], doc["scenarios"] = {f"job {i}": 1.0 for i in range(100)}, {}
    return doc


VALUES = {
    "every number null": (_everywhere(WALK, None), ["not drawn: no curve holds a number"], ["-"]),
    "every number at a double's limit": (_everywhere(WALK, 1e308), ["not drawn"], ["1.00e+308", "inf %"]),
    "every number negative": (_everywhere(WALK, -1e308), ["not drawn"], ["-1.00e+308"]),
    "every number text": (_everywhere(WALK, "12 <b>"), ["not drawn"], ["12 &lt;b&gt;"]),
    "every number true": (_everywhere(WALK, True), ["not drawn"], ["yes"]),
    "long lists": (_long(), ["the first 40 of 1000 rows", "the first 8 of 20 plans", "the first 12 of 500 blocks",
                             "the first 40 of 100 jobs"], []),
    "parts missing": ({"title": "Decoder walk"}, [], []),
}


@pytest.mark.parametrize("case", list(VALUES))
def test_any_values_are_shown_as_text_and_cut(case: str, walked: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. Numbers a file may hold in any place (null, ±1e308, text, a bool) and
    lists of any length: the pages are written (exit 0, nothing left out), each figure drawn or
    "not drawn" with the reason, tables cut with a note."""
    doc, notes, cells = VALUES[case]
    folder = tmp_path / "r"
    folder.mkdir()
    shutil.copy(walked / "report.json", folder)
    (folder / WALK_FILE).write_text(json.dumps(doc))
    assert main(["report", "render", str(folder), "--maps", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "not shown" not in captured.err and "Traceback" not in captured.err, captured.err
    page = html_section((folder / "report.html").read_text())
    md = md_section((folder / "report.md").read_text())
    for text in notes:
        assert text in page and (text.startswith("not drawn") or text in md), text  # only the page draws
    for text in cells:
        assert text in page, text
    figures = len(IMAGE.findall(page)) + page.count("not drawn:")
    assert figures == (0 if case == "parts missing" else 2), page[:2000]


def test_a_report_of_another_command_leaves_the_walk_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``run`` into a walk's folder keeps the walk's file but does not show it as its own."""
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(_small_report()))
    (folder / WALK_FILE).write_text(json.dumps(WALK))
    assert main(["report", "render", str(folder), "--maps", str(tmp_path)]) == 0
    page, md = (folder / "report.html").read_text(), (folder / "report.md").read_text()
    assert "decoder-walk" not in page and "## Decoder walk" not in md
    assert html_text(render.WALK_LEFT_OUT) in page and md_text(render.WALK_LEFT_OUT) in md
    assert (folder / WALK_FILE).exists()


def test_a_walk_over_the_size_bound_is_named(walked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk handed over in memory is held to the bound of one read from the folder: the file is
    written, the pages name it under "Not shown"."""
    monkeypatch.setattr(render, "MAX_STUDY_BYTES", 1000)
    seen: list[str] = []
    render.write_report(report.load(walked), tmp_path / "r", not_shown=seen.append,
                        extra_files={WALK_FILE: copy.deepcopy(WALK) | {"pad": "x" * 2000}})
    (line,) = seen
    assert WALK_FILE in line and "1000 bytes" in line, line
    page = (tmp_path / "r" / "report.html").read_text()
    assert "decoder-walk" not in page and WALK_FILE in page.split("Not shown", 1)[1]
    assert json.loads((tmp_path / "r" / WALK_FILE).read_text())["pad"] == "x" * 2000
