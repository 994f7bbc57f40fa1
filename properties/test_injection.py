"""A report is untrusted input (a CI artifact of someone's pull request), and so are
``nightly.json`` and ``decoder_walk.json`` beside it, a maps folder and its map, summary and
study files. Whatever their strings hold, they reach ``report.html``, ``report.md``, ``report
compare --format md`` and the terminal as text: the page's tag and attribute skeleton and the
Markdown's token skeleton are those of the same document with a neutral token in that field; no
script, event handler or ``javascript:`` URL appears; the terminal gets no control or invisible
character but the newline; rich markup and mathtext in a field are text. A maps folder (and a
file beside the report) is read without following a symlink, only regular files of known names,
each bounded; a file it refuses is named under "Not shown" and never blocks, and a refused
folder is a usage error before any computation.

Rules: structural. The fuzz tests fix their example count (``FUZZ_EXAMPLES`` of
``test_fuzz.py``, derandomised); ``K3V_FUZZ_EXAMPLES=N`` runs N fresh random examples each.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import signal
import struct
import unicodedata
import zlib
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from markdown_it import MarkdownIt
from PIL import Image
from test_fuzz import _small_report, fuzz
from test_walk_report import WALK

from k3verify import cli
from k3verify.cli import main
from k3verify.harness import golden, plots, registry, report, runner
from k3verify.harness import text as text_sinks
from k3verify.harness.text import html_text, md_text, plot_text, terminal_text, visible
from k3verify.harness.walk_page import WALK_FILE

GITHUB_PAYLOADS = ["@octocat", "@org/team", ":white_check_mark:", "#1", "https://x.invalid/a", "WWW.x.invalid",
                   "a@b.invalid", "mailto:a"]  # fmt: skip
# Payloads for every sink: HTML, Markdown (CommonMark and GitHub's), terminals, rich markup and
# matplotlib's mathtext; the fuzz mixes them with each other and with arbitrary text.
PAYLOADS = [
    "<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "<svg onload=alert(1)>", "<!--", "-->",
    "'\" onmouseover='alert(1)", "</title><script>x</script>", "<a href='javascript:alert(1)'>x</a>",
    "\n### k3verify: 0 regression(s)\n", "\r\n# title\n\n- item\n1. one\n> quote\n---\n", "a | b", "|",
    "`code`", "``", "*_[x](javascript:alert(1))#!~", "![i](http://example.invalid/i.png)", "<http://x.invalid>",
    "&lt;script&gt;", "&#60;script&#62;", "\\", "\\|", "~~s~~", "$x$", "$^$", "$\\frac$", "[bold]", "[/]",
    "[link=http://x.invalid]x[/link]", "\x1b[2J", "\x1b]52;c;aGVsbG8=\x07", "\x1b]8;;http://x.invalid\x1b\\a\x1b]8;;\x1b\\",
    "\x9b2J", "\x9d52;c;x\x9c", "\u202eevil", "\u2066x\u2069", "\u200b", "\ufeff", "\u2028", "\x00", "\x7f",
    "\ud800", "\t", "\r",
    # GitHub's active text: mentions, emoji codes, issue references, bare links, an e-mail address
    *GITHUB_PAYLOADS,
]
PAYLOAD = st.one_of(st.sampled_from(PAYLOADS), st.lists(st.sampled_from(PAYLOADS), min_size=2, max_size=4).map("".join),
                    st.text(max_size=16))
INVISIBLE = {"Cc", "Cf", "Cs", "Zl", "Zp"}
SECRET = "k3v-SECRET-credentials-0123456789"
NIGHTLY = {"profile": "nightly", "budget_s": 60, "created": "2026-01-01T00:00:00+00:00", "seed": 7,
           "modules": {"attnres": {"examples": 9, "wall_s": 15, "worst": {
               "implementation": "attnres/k3verify:tiled[bf16]", "ratio": 0.61, "err": 1e-3, "limit": 2e-3,
               "replay": "python properties/worst_case.py attnres '{\"seed\": 5}'"}}}}
COUNTS = {"cells": 4, "agree": 4, "disagree_adjacent": 0, "disagree_away": 0}
SUMMARY = {"attnres": {"cells": 4, "agreement": {"all": COUNTS}, "environment": {"git_commit": "abc123"}}}
STUDY_NAME = "attnres_depth_drift.json"
STUDY = {"title": "Block AttnRes: error against depth", "layers": [1, 2, 3], "sublayer": ["attn", "mlp", "attn"],
         "metric": "rms_ratio", "error_bf16": [1e-3, 2e-3, 3e-3], "error_fp32": [1e-7, 2e-7, 3e-7], "note": "a study"}
MAP_NAME = "attnres_overflow_map.json"
MAP = {"module": "attnres", "environment": {"git_commit": "def456"},
       "spec": {"x": "g", "y": "tile", "panel_row": "dtype", "panel_col": "kind", "figure": "variant",
                "x_label": "g", "y_label": "tile", "title": "toy map"},
       "meta": {"agreement": {"all": COUNTS}},
       "cells": [{"module": "attnres", "dtype": "bf16", "tile": 4, "g": g, "kind": "worst", "variant": "v",
                  "finite": g < 3, "predicted_finite": g < 3, "rms_ratio": 1e-3 if g < 3 else None} for g in (1, 5)]}


def _png(width: int = 2, height: int = 2) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(buf, format="PNG")
    return buf.getvalue()


# --- where a payload goes -------------------------------------------------------------------------


def _targets(doc: Any, prefix: tuple = (), scalars: bool = False) -> list[tuple[tuple, str]]:
    """Every string leaf (``value``) and dict key (``key``) of ``doc``; with ``scalars``, every
    scalar leaf too (a report's config, summary and environment hold numbers a payload may replace)."""
    out: list[tuple[tuple, str]] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        here = (*prefix, key)
        if isinstance(doc, dict):
            out.append((here, "key"))
        if isinstance(value, (dict, list)):
            out += _targets(value, here, scalars)
        elif isinstance(value, str) or scalars:
            out.append((here, "value"))
    return out


def _report_targets(doc: dict[str, Any]) -> list[tuple[tuple, str]]:
    """The report's string leaves and keys, and every scalar of its config, summary and environment."""
    out = _targets(doc)
    for key in ("config", "summary", "environment"):
        out += [t for t in _targets(doc[key], (key,), scalars=True) if t not in out]
    return out


def _put(doc: Any, path: tuple, kind: str, text: str) -> Any:
    """A copy of ``doc`` with the value at ``path`` (``kind`` ``value``) or the key naming it
    (``key``, renamed in place) replaced by ``text``."""
    new = copy.deepcopy(doc)
    parent = new
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if kind == "value":
        parent[last] = text
    else:
        items = list(parent.items())
        parent.clear()
        parent.update((text if k == last else k, v) for k, v in items)
    return new


def _field(payload: str) -> str:
    """What a fuzzed field holds: the payload between fixed letters, so that it is never a value
    with a meaning (a status, ``fp64``, another row's module) and compares with :data:`NEUTRAL`."""
    return f"k3v{payload}k3v"


NEUTRAL = _field("neutral")


# --- skeletons ------------------------------------------------------------------------------------


class _Skeleton(HTMLParser):
    """Tags with their attribute names, comments, declarations and processing instructions, in
    order; and every attribute as given."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.items: list[tuple] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.items.append(("start", tag, tuple(sorted(a for a, _ in attrs))))
        self.attrs += attrs

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        self.items.append(("end", tag))

    def handle_comment(self, data: str) -> None:
        self.items.append(("comment",))

    def handle_decl(self, decl: str) -> None:
        self.items.append(("decl", decl))

    def handle_pi(self, data: str) -> None:
        self.items.append(("pi",))

    def unknown_decl(self, data: str) -> None:
        self.items.append(("unknown decl",))


# Attributes whose value a browser loads or follows as a URL.
URL_ATTRIBUTES = {"href", "src", "srcset", "action", "formaction", "background", "poster", "data", "xlink:href",
                  "ping", "cite", "longdesc", "manifest", "codebase", "archive"}


def html_skeleton(page: str) -> list[tuple]:
    """The page's skeleton; fails on a script, an event handler or a ``javascript:`` URL."""
    parser = _Skeleton()
    parser.feed(page)
    parser.close()
    assert not [i for i in parser.items if i[:2] == ("start", "script")], "a <script> in the page"
    assert not [a for a, _ in parser.attrs if a.lower().startswith("on")], "an event handler in the page"
    urls = [v for a, v in parser.attrs if a in URL_ATTRIBUTES and v]
    assert not [v for v in urls if "javascript:" in "".join(v.lower().split())], "a javascript: URL"
    return parser.items


MD = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def md_skeleton(text: str) -> tuple[list[tuple], list[str]]:
    """The token types of the Markdown (text tokens aside: how text splits is no structure), with
    heading levels and table cells among them; and the raw HTML tokens' content."""
    skeleton, raw = [], []

    def walk(tokens: list[Any]) -> None:
        for t in tokens:
            if t.type != "text":
                skeleton.append((t.type, t.tag, t.nesting))
            if t.type in ("html_inline", "html_block"):
                raw.append(t.content)
            walk(t.children or [])

    walk(MD.parse(text))
    return skeleton, raw


def invisible(text: str) -> list[str]:
    """Characters a terminal would act on or not show: control and format characters but ``\\n``."""
    return sorted({repr(c) for c in text if c != "\n" and unicodedata.category(c) in INVISIBLE})


# --- the escapers on their own ---------------------------------------------------------------------


@fuzz
@given(text=st.one_of(PAYLOAD, st.text()))
def test_the_escapers_leave_nothing_invisible_or_active(text: str) -> None:
    for escaped in (html_text(text), md_text(text), terminal_text(text), plot_text(text)):
        assert not invisible(escaped.replace("\t", "")), (text, escaped)
    assert not set("<>") & set(html_text(text)) and not set("<>\n\r") & set(md_text(text))
    inline = MD.parse("x " + md_text(text))[1]
    assert [t.type for t in inline.children] == ["text"], (text, md_text(text))  # no markup, however nested


# GitHub's own recognizers of active text in Markdown it shows, run on the text a reader sees
# (entities and backslash escapes resolved): a mention, an emoji code, an issue reference, a link
# by scheme or by ``www.``, an e-mail address.
GITHUB_ACTIVE = re.compile(r"(?<![\w`])@\w|:[\w+-]+:|(?<!\w)#\d|\b(?:https?|ftp|mailto):/*\w|\bwww\.\w"
                           r"|[\w.+-]@[\w-]+\.\w", re.IGNORECASE)  # fmt: skip


def _shown(inline: str) -> str:
    """The text a reader sees of one line of inline Markdown after ``x `` (a paragraph of text)."""
    return "".join(t.content for t in MD.parse("x " + inline)[1].children).rstrip()


@fuzz
@given(text=st.one_of(PAYLOAD, st.text(alphabet="@:#/.wW_+-a1 \\", max_size=24)))
def test_markdown_text_leaves_github_nothing_to_activate(text: str) -> None:
    """Structural: the shown text of ``md_text`` has no mention, emoji code, issue reference or
    bare link for GitHub to act on, and loses nothing: without its zero-width spaces it is the
    text itself (visible, line breaks and tabs as spaces)."""
    shown = _shown(md_text(text))
    assert not GITHUB_ACTIVE.search(shown), (text, md_text(text), shown)
    assert shown.replace("\u200b", "") == ("x " + visible(re.sub(r"\r\n|[\r\n\t]", " ", text))).rstrip(), (text, shown)


def test_github_active_text_is_found_where_md_text_does_not_break_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant: ``md_text`` without its zero-width spaces (backslash escapes only) leaves every
    GitHub payload active, and the recognizer finds each."""
    monkeypatch.setattr(text_sinks, "_GITHUB_ACTIVE", re.compile(r"(?!)"))
    assert [p for p in GITHUB_PAYLOADS if not GITHUB_ACTIVE.search(_shown(md_text(p)))] == []


# --- report.html and report.md ---------------------------------------------------------------------


def _bundle() -> dict[str, Any]:
    """The report and the files beside it, as fresh copies (tests edit them in place); the
    report says it covers the decoder too, so its pages show the decoder walk beside it."""
    report_doc = _small_report()
    report_doc["config"]["modules"] = [*report_doc["config"]["modules"], "decoder"]
    return copy.deepcopy({"report": report_doc, "nightly": NIGHTLY, "summary": SUMMARY, "study": STUDY,
                          "map": MAP, "walk": WALK})


def _bundle_targets(bundle: dict[str, Any]) -> list[tuple[tuple, str]]:
    out = [(("report", *p), k) for p, k in _report_targets(bundle["report"])]
    for name in ("nightly", "summary", "study", "map", "walk"):
        out += [((name, *p), k) for p, k in _targets(bundle[name])]
    return out


def _write_bundle(bundle: dict[str, Any], root: Path) -> tuple[Path, Path]:
    """The report (with its nightly results and decoder walk) and a maps folder (summary, study,
    map JSON, one map PNG)."""
    report_dir, maps = root / "report", root / "maps"
    report_dir.mkdir(parents=True)
    maps.mkdir()
    (report_dir / "report.json").write_text(json.dumps(bundle["report"]))
    (report_dir / "nightly.json").write_text(json.dumps(bundle["nightly"]))
    (report_dir / WALK_FILE).write_text(json.dumps(bundle["walk"]))
    (maps / "summary.json").write_text(json.dumps(bundle["summary"]))
    (maps / STUDY_NAME).write_text(json.dumps(bundle["study"]))
    (maps / MAP_NAME).write_text(json.dumps(bundle["map"]))
    (maps / "attnres_overflow_map_variant-v.png").write_bytes(_png())
    return report_dir, maps


@pytest.fixture
def no_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's figures left out (matplotlib takes most of a render; what a figure draws from
    a field is tested with figures on, below)."""
    for name in ("position_figure", "ulp_figure", "depth_figure", "series_figure", "walk_depth_figure",
                 "walk_decode_figure"):
        monkeypatch.setattr(plots, name, lambda *args, **kwargs: None)
    monkeypatch.delenv("FORCE_COLOR", raising=False)


def _render(bundle: dict[str, Any], root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str, str]:
    report_dir, maps = _write_bundle(bundle, root)
    code = main(["report", "render", str(report_dir), "--maps", str(maps)])
    out, err = capsys.readouterr()
    assert not invisible(out + err), (out + err)[-500:]
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    if code != 0:
        return code, err, "", ""
    return code, err, (report_dir / "report.html").read_text(), (report_dir / "report.md").read_text()


def test_render_of_the_neutral_bundle_shows_every_part(no_figures: None, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The fuzz below compares against this page: it must show what the fields feed."""
    code, err, page, md = _render(_bundle(), tmp_path, capsys)
    assert code == 0 and err == "", err
    for text in ("Nightly worst-case search", "Overflow map", "Block AttnRes: error against depth",
                 "attnres/k3verify:tiled[bf16]", "Analytic prediction against observation", "Notes", "Decoder walk",
                 "fp64 chunkwise, kda as tiled bf16", "first divergence at sublayer 3", "prefill_decode"):
        assert text in page, text
    assert "Not shown" not in page and "## Nightly worst-case search" in md
    for heading in ("Decoder walk", "Depth drift", "Decode steps", "Attribution", "Routing flips", "First divergence",
                    "Job times"):
        assert f"{heading}</h" in page and f"# {heading}\n" in md, heading


@fuzz
@given(data=st.data(), payload=PAYLOAD)
def test_a_payload_in_any_field_keeps_the_pages_skeleton(data: st.DataObject, payload: str, no_figures: None,
                                                         tmp_path_factory: pytest.TempPathFactory,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. The same field holding the payload or a neutral token: the same HTML tag
    and attribute skeleton, no script, handler or javascript: URL; the same Markdown tokens,
    headings and table cells, no raw HTML; the same exit status and no traceback."""
    bundle = _bundle()
    path, kind = data.draw(st.sampled_from(_bundle_targets(bundle)), label="field")
    root = tmp_path_factory.mktemp("inject")
    results = [_render(_put(bundle, path, kind, text), root / name, capsys)
               for name, text in (("neutral", NEUTRAL), ("payload", _field(payload)))]
    (code, _, page, md), (code_p, err_p, page_p, md_p) = results
    assert code_p == code, (path, err_p)
    if code == 0:
        assert html_skeleton(page_p) == html_skeleton(page), path
        assert md_skeleton(md_p) == md_skeleton(md), path
        assert md_skeleton(md_p)[1] == [], path


# The decoder walk's objects keyed by names of the walk (plans, jobs, scenarios), not of its format.
WALK_NAMED_KEYS = {("depth_drift", "curves"), ("depth_drift", "y_curves"), ("depth_drift", "block_growth"),
                   ("depth_drift", "growth_per_block"), ("seconds",), ("scenarios",)}


def _every_walk_string(text: Callable[[int], str]) -> dict[str, Any]:
    """:data:`WALK` with every string and every name it keys an object by replaced, the i-th
    distinct one by ``text(i)`` wherever it occurs (a plan's curve and its growth keep one name)."""
    names: dict[str, str] = {}

    def new(value: str) -> str:
        return names.setdefault(value, text(len(names)))

    def replaced(value: Any, path: tuple) -> Any:
        if isinstance(value, dict):
            return {new(k) if path in WALK_NAMED_KEYS else k: replaced(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [replaced(v, path) for v in value]
        return new(value) if isinstance(value, str) else value

    return replaced(WALK, ())


@pytest.mark.parametrize("order", ["as listed", "reversed"])
def test_payloads_in_every_string_of_the_decoder_walk_stay_text(order: str, no_figures: None, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. Every payload at once in every string of ``decoder_walk.json`` and
    every plan, job and scenario name (the fuzz above puts one in one field): the walk's section
    has the tag and Markdown skeleton it has with neutral tokens there, and no raw HTML."""
    payload = "".join(PAYLOADS if order == "as listed" else reversed(PAYLOADS))
    results = []
    for name, token in (("neutral", "neutral"), ("payload", payload)):
        bundle = _bundle()
        bundle["walk"] = _every_walk_string(lambda i, token=token: _field(f"{token}{i}"))
        results.append(_render(bundle, tmp_path / name, capsys))
    (code, err, page, md), (code_p, err_p, page_p, md_p) = results
    assert code == code_p == 0 and err == err_p == "", err_p
    assert page_p.count("<section id='decoder-walk'>") == 1 and md_p.count("## Decoder walk\n") == 1
    assert html_skeleton(page_p) == html_skeleton(page)
    assert md_skeleton(md_p) == md_skeleton(md) and md_skeleton(md_p)[1] == []


# --- report compare --format md, and the terminal ----------------------------------------------------


def _compare_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    """A base report and a new one with a regression (a pass flipped to fail, with a reason), a
    change (a new row) and the rest as it was."""
    base = _small_report()
    new = copy.deepcopy(base)
    row = next(r for r in new["rows"] if r["status"] == "pass" and r.get("outputs"))  # a judged row, not the oracle's
    for judged in (row, row["outputs"][row["output"]]):
        judged["status"] = judged["verdict"]["status"] = "fail"
        judged["verdict"]["reason"] = "planted"
    new["rows"].append(copy.deepcopy(base["rows"][0]) | {"implementation": "added"})
    new["summary"] = report.summarize(new["rows"])
    return base, new


def _compare(base: dict[str, Any], new: dict[str, Any], root: Path,
             capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``report compare`` as a table and as Markdown: the exit status, the table output, the Markdown."""
    for name, doc in (("base", base), ("new", new)):
        (root / name).mkdir(parents=True)
        (root / name / "report.json").write_text(json.dumps(doc))
    outputs = []
    for fmt in ("table", "md"):
        code = main(["report", "compare", str(root / "base"), str(root / "new"), "--format", fmt])
        out, err = capsys.readouterr()
        assert not invisible(out + err), (fmt, (out + err)[-500:])
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
        outputs.append((code, out))
    assert outputs[0][0] == outputs[1][0]
    return outputs[0][0], outputs[0][1], outputs[1][1]


@fuzz
@given(data=st.data(), payload=PAYLOAD)
def test_a_payload_in_a_compared_report_stays_text(data: st.DataObject, payload: str,
                                                    tmp_path_factory: pytest.TempPathFactory,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: structural. A payload in any field of the new report: ``report compare``'s table
    and REGRESSION lines hold no control character, and its pull-request comment has the
    neutral token's Markdown skeleton (one heading, the same tables) and no raw HTML of its own."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    base, new = _compare_pair()
    targets = _report_targets(new)
    # Half the draws go to the fields the comment shows (most of a report's leaves are metrics it
    # never prints), so that each kind of payload meets them within the fixed example count.
    shown = [t for t in targets if _shown_in_compare(t[0])]
    path, kind = data.draw(st.one_of(st.sampled_from(shown), st.sampled_from(targets)), label="field")
    root = tmp_path_factory.mktemp("compare")
    code, _, md = _compare(base, _put(new, path, kind, NEUTRAL), root / "neutral", capsys)
    code_p, table_p, md_p = _compare(base, _put(new, path, kind, _field(payload)), root / "payload", capsys)
    assert code_p == code, (path, table_p[-500:])
    if code != 2:
        assert md_skeleton(md_p) == md_skeleton(md), path
        assert md_p.count("### ") == 1 and md_p.startswith("### k3verify: ")


def _shown_in_compare(path: tuple) -> bool:
    """Whether ``report compare`` prints the field at ``path`` of the new report of
    :func:`_compare_pair`: a row's names (in every finding's subject), reasons, the environment
    it notes, the modules it covers."""
    if path[0] == "rows":
        return len(path) > 2 and (path[2] in ("module", "implementation", "form", "dtype", "case", "params")
                                  or "reason" in path)
    return path[:2] in (("environment", "torch"), ("environment", "device"), ("environment", "fla-core"),
                        ("environment", "math_platform"), ("config", "modules"))


def test_the_compare_comment_shows_the_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fuzz above compares against this comment: regressions, other changes and notes."""
    code, table, md = _compare(*_compare_pair(), tmp_path, capsys)
    assert code == 1 and "REGRESSION verdict flipped" in table
    assert "**Regressions**" in md and "Other changes" in md and "planted" in md


@fuzz
@given(data=st.data(), payload=PAYLOAD)
def test_a_payload_in_a_row_or_the_environment_never_reaches_the_terminal(
    data: st.DataObject, payload: str, no_figures: None, tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule: structural. ``k3verify run`` (the runner stubbed to return the payload's rows, the
    environment stubbed to hold it) prints its table, its one-line-per-row form, its FAIL,
    unavailable and overflow lines and its Markdown (what ``--format md`` prints; the pages are
    written by a stub here, the page tests above cover them) without a control character, and
    ends as it does with the neutral token (rich markup in a field is text)."""
    doc = _compare_pair()[1]
    # The runner's rows always carry their keys (the fuzz of report files renames those): here the
    # values, and the keys inside a row (parameters, outputs, metrics).
    targets = [(p, k) for p, k in _report_targets(doc) if p[0] in ("rows", "environment") and len(p) > 1
               and not (p[0] == "rows" and k == "key" and len(p) == 3)]
    path, kind = data.draw(st.sampled_from(targets), label="field")
    root = tmp_path_factory.mktemp("run")
    (root / "maps").mkdir()
    pages: list[str] = []

    def write(doc: dict[str, Any], out_dir: Path, **kwargs: Any) -> list[Path]:
        """The pages are the other tests' business; what --format md prints is kept."""
        pages.append(report.markdown(doc))
        return [out_dir / name for name in report.REPORT_FILES]

    monkeypatch.setattr(cli, "write_report", write)
    codes = []
    for name, text in (("neutral", NEUTRAL), ("payload", _field(payload))):
        fuzzed = _put(doc, path, kind, text)
        monkeypatch.setattr(runner, "run", lambda entries, seed, progress, rows=fuzzed["rows"], **kw: iter(rows))
        monkeypatch.setattr(runner, "plan", lambda *a, rows=fuzzed["rows"], **kw: list(rows))
        monkeypatch.setattr(cli, "environment", lambda env=fuzzed["environment"]: env)
        # A table, then a line per row; the neutral token only for the exit status to compare with.
        for columns in ("170", "80") if name == "payload" else ("170",):
            monkeypatch.setenv("COLUMNS", columns)
            code = main(["run", "--modules", "attnres", "--out", str(root / name), "--maps", str(root / "maps"),
                         "--goldens", "none"])
            out, err = capsys.readouterr()
            out += pages.pop()
            assert not invisible(out + err), (path, columns, (out + err)[-500:])
            assert "Traceback" not in err
            codes.append((name == "payload", code))
    assert {c for p, c in codes if p} == {c for p, c in codes if not p}, (path, codes)


@pytest.mark.parametrize("payload", ["\x1b[2J\x1b]52;c;aGk=\x07", "[/]", "[bold]x", "\u202e\x9b"])
def test_list_prints_a_plugin_name_and_reason_as_text(payload: str, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. A plugin names its implementation and its failure's text (an exception's
    message): ``k3verify list`` prints both without a control character, brackets as brackets."""
    def broken() -> tuple[bool, str]:
        return False, f"import failed: {payload}"

    impl = registry.implementation("mla", lambda *a, **k: None, name=f"evil{payload}", is_available=broken)
    monkeypatch.setattr(registry, "orphan_implementations", lambda: [impl])
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert not invisible(out) and f"evil{terminal_text(payload)}" in out, out[-800:]


def test_the_progress_bar_shows_a_label_as_text() -> None:
    """Rule: structural. On a terminal the progress bar shows the row being verified, whose label
    a plugin names: as visible text, brackets as brackets."""
    from rich.console import Console

    progress = cli._progress(Console(file=io.StringIO(), force_terminal=True))
    task = progress.add_task("verifying [/]", total=2, current="")
    progress.update(task, current="evil[/]\x1b]52;c;aGk=\x07\u202e")
    shown = [column(progress.tasks[0]) for column in progress.columns]
    texts = [t.plain for t in shown if hasattr(t, "plain")]
    assert "verifying [/]" in texts and "evil[/]\\x1b]52;c;aGk=\\x07\\u202e" in texts, texts
    assert not invisible("".join(texts))


# --- figures: mathtext and control characters in every text they draw ----------------------------------


@pytest.mark.parametrize("payload", ["$^$ $\\frac$ $x_$ \x00\x1b[2J\u202e \ud800", "long" * 5000 + "\n" * 500],
                         ids=["mathtext and controls", "20 000 characters"])
def test_figures_draw_any_text_as_text(payload: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. The payload in every string and key of the report's rows, the study,
    the decoder walk and a map drawn from its JSON (no PNG beside it), with figures on: the page renders (exit 0,
    every figure embedded) instead of stopping at matplotlib's mathtext parser or growing a
    figure past the pixels a page embeds (a 20 000-character label)."""
    bundle, text = _bundle(), _field(payload)
    for row in bundle["report"]["rows"]:  # every row feeds the position and ULP figures
        if "outputs" in row:  # the binding output renamed where the row names it, so the row stays whole
            row["outputs"] = {text if k == row["output"] else k: v for k, v in row["outputs"].items()}
            row["output"] = text
        row |= {"implementation": text, "form": text, "dtype": text, "case": text,
                "baseline_form": text, "params": {text: text}, "error_by_position": [1e-3, 2e-3, 3e-3],
                "baseline_error_by_position": [1e-3, 1e-3, 1e-3],
                "ulp_histogram": {"edges": [0, 0.5, 1, None], "counts": [5, 3, 1], "dtype": "bf16"}}
    bundle["study"] |= {"title": text, "metric": text, "sublayer": [text, "mlp", text], f"error_{text}": [1, 2, 3]}
    bundle["walk"] = _every_walk_string(lambda i: f"{text}{i}")
    bundle["map"]["spec"] |= {"title": text, "x_label": text, "y_label": text, "operating_label": text,
                              "operating_point": [["g", 1]]}
    for cell in bundle["map"]["cells"]:
        cell |= {"kind": text, "dtype": text, "variant": text}
    report_dir, maps = _write_bundle(bundle, tmp_path)
    (maps / "attnres_overflow_map_variant-v.png").unlink()  # the map is drawn from its JSON
    assert main(["report", "render", str(report_dir), "--maps", str(maps)]) == 0
    captured = capsys.readouterr()
    assert not invisible(captured.out + captured.err) and "not shown" not in captured.err, captured.err
    page = (report_dir / "report.html").read_text()
    assert "not drawn" not in page and "Not shown" not in page
    # position, ULP histograms, the map drawn from JSON, the depth-drift study, the walk's two curves
    assert page.count('src="data:image/png;base64,') == 6, page.count("<img")


# --- the maps folder: only regular files of known names, inside it, bounded ------------------------------


def _checkout(root: Path) -> Path:
    """A report and beside it a credentials file that must never reach a page."""
    report_dir = root / "r"
    report_dir.mkdir(parents=True)
    (report_dir / "report.json").write_text(json.dumps(_small_report()))
    (root / "credentials.json").write_text(json.dumps({"token": SECRET}))
    return report_dir


def _rendered(report_dir: Path) -> str:
    return "".join((report_dir / n).read_text() for n in ("report.html", "report.md") if (report_dir / n).exists())


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def expired(*args: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _huge_dimensions_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width`` x ``height`` pixels (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


REFUSED_FILES = {
    "a PNG that is a symlink": lambda maps, root: (maps / "attnres_overflow_map_x-a.png").symlink_to(
        root / "credentials.json"),
    "a study that is a symlink": lambda maps, root: (maps / STUDY_NAME).symlink_to(root / "credentials.json"),
    "a map JSON that is a symlink": lambda maps, root: (maps / MAP_NAME).symlink_to(root / "credentials.json"),
    "summary.json that is a symlink": lambda maps, root: (maps / "summary.json").symlink_to(root / "credentials.json"),
    "a PNG that is a FIFO": lambda maps, root: os.mkfifo(maps / "attnres_overflow_map_x-a.png"),
    "a PNG that is /dev/zero": lambda maps, root: (maps / "attnres_overflow_map_x-a.png").symlink_to("/dev/zero"),
    "a PNG larger than the bound": lambda maps, root: os.truncate(_touch(maps / "attnres_overflow_map_x-a.png"),
                                                                  17 * 1024 * 1024),
    "a 20000 x 20000 PNG": lambda maps, root: (maps / "attnres_overflow_map_x-a.png").write_bytes(
        _huge_dimensions_png(20000, 20000)),
    "a PNG that is a folder": lambda maps, root: (maps / "attnres_overflow_map_x-a.png").mkdir(),
    "a PNG that is not a PNG": lambda maps, root: (maps / "attnres_overflow_map_x-a.png").write_text(SECRET),
}


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("case", list(REFUSED_FILES))
def test_a_refused_file_is_named_and_never_shown(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. A file the maps folder must not show is left out of both pages and
    named under "Not shown" and in one stderr line; the render ends (exit 0) within its deadline
    and no byte of another file reaches a page."""
    report_dir = _checkout(tmp_path)
    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / "credentials.json").write_text(json.dumps({"token": SECRET}))  # not a name a page reads
    REFUSED_FILES[case](maps, tmp_path)
    with _deadline(60):
        code = main(["report", "render", str(report_dir), "--maps", str(maps)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (line,) = captured.err.strip().splitlines()
    assert "not shown" in line and str(maps) in line and "Traceback" not in line, line
    pages = _rendered(report_dir)
    assert SECRET not in pages and SECRET not in captured.out + captured.err
    assert "Not shown" in (report_dir / "report.html").read_text() and "## Not shown" in pages


@pytest.mark.parametrize("how", ["--maps is a symlink", "--maps below a symlink", "default maps are a symlink",
                                 "default maps below a symlink"])
def test_a_maps_folder_through_a_symlink_is_refused(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. A maps folder reached through a symlink (given, or the default
    ``reports/baseline/maps`` of a checkout, or the ``reports`` above it) is a usage error in one
    line, exit 2, and nothing is written: the files it points at never reach a page."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / STUDY_NAME).write_text(json.dumps({"title": SECRET, "layers": [1], "error_x": [1]}))
    (elsewhere / "credentials.json").write_text(SECRET)
    work = tmp_path / "work"
    report_dir = _checkout(work)
    monkeypatch.chdir(work)
    args = ["report", "render", str(report_dir)]
    if how == "--maps is a symlink":
        (work / "maps").symlink_to(elsewhere)
        args += ["--maps", "maps"]
    elif how == "--maps below a symlink":
        (work / "up").symlink_to(tmp_path)
        args += ["--maps", "up/elsewhere"]
    elif how == "default maps are a symlink":
        (work / "reports" / "baseline").mkdir(parents=True)
        (work / "reports" / "baseline" / "maps").symlink_to(elsewhere)
    else:
        (work / "reports").symlink_to(tmp_path / "fake-reports")
        (tmp_path / "fake-reports" / "baseline").mkdir(parents=True)
        (tmp_path / "fake-reports" / "baseline" / "maps").symlink_to(elsewhere)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "symlink" in err and "Traceback" not in err, err
    assert not (report_dir / "report.html").exists() and SECRET not in err


@pytest.mark.parametrize("bad", ["missing", "a file", "a symlink"])
def test_a_bad_maps_folder_exits_2_before_any_verification(bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. ``run --maps BAD`` is refused before the runner starts."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the verification started before --maps was checked")

    monkeypatch.setattr(runner, "run", refuse)
    maps = tmp_path / "maps"
    if bad == "a file":
        maps.write_text("x")
    elif bad == "a symlink":
        (tmp_path / "real").mkdir()
        maps.symlink_to(tmp_path / "real")
    assert main(["run", "--modules", "mla", "--out", str(tmp_path / "out"), "--maps", str(maps)]) == 2
    err = capsys.readouterr().err
    assert str(maps) in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# --- malformed files beside a report: a note, never a traceback ---------------------------------------

MALFORMED = {
    "nightly.json not JSON": ("report", "nightly.json", "{"),
    "nightly.json a list": ("report", "nightly.json", "[1, 2]"),
    "nightly modules a list": ("report", "nightly.json", '{"modules": [1]}'),
    "nightly module not an object": ("report", "nightly.json", '{"modules": {"kda": 3}}'),
    "nightly worst a list": ("report", "nightly.json", '{"modules": {"kda": {"worst": [1]}}}'),
    "summary.json a list": ("maps", "summary.json", "[1]"),
    "summary module a number": ("maps", "summary.json", '{"kda": 3}'),
    "summary agreement a list": ("maps", "summary.json", '{"kda": {"agreement": [1]}}'),
    "summary commit a number": ("maps", "summary.json", '{"kda": {"environment": {"git_commit": 5}}}'),
    "study not JSON": ("maps", STUDY_NAME, "{'a': 1}"),
    "study nested too deep": ("maps", STUDY_NAME, "[" * 200 + "]" * 200),
    "map without cells": ("maps", MAP_NAME, json.dumps(MAP | {"cells": []})),
    "map spec with an unknown key": ("maps", MAP_NAME, json.dumps(MAP | {"spec": MAP["spec"] | {"evil": 1}})),
    "map of another module": ("maps", MAP_NAME, json.dumps(MAP | {"module": "../../x"})),
    "map mixing text and numbers": ("maps", MAP_NAME, json.dumps(
        MAP | {"cells": [MAP["cells"][0], MAP["cells"][1] | {"g": "five"}]})),
    "map rms_ratio text": ("maps", MAP_NAME, json.dumps(MAP | {"cells": [MAP["cells"][0] | {"rms_ratio": "x"}]})),
    "map grid too large": ("maps", MAP_NAME, json.dumps(MAP | {"cells": [
        MAP["cells"][0] | {"g": i, "tile": i} for i in range(500)]})),
    "decoder walk not JSON": ("report", WALK_FILE, "{"),
    "decoder walk a list": ("report", WALK_FILE, "[1, 2]"),
    "decoder walk with NaN": ("report", WALK_FILE, '{"fp64": {"worst_h": NaN}}'),
    "decoder walk nested too deep": ("report", WALK_FILE, '{"x": ' + "[" * 200 + "]" * 200 + "}"),
    "decoder walk too large": ("report", WALK_FILE, json.dumps({"x": "y" * (4 * 1024 * 1024)})),
    "decoder walk curves a list": ("report", WALK_FILE, json.dumps(
        WALK | {"depth_drift": WALK["depth_drift"] | {"curves": [[1e-3]]}})),
    "decoder walk curve a number": ("report", WALK_FILE, json.dumps(
        WALK | {"depth_drift": WALK["depth_drift"] | {"curves": {"\x1b[2J<b>": 3}}})),
    "decoder walk attribution of numbers": ("report", WALK_FILE, json.dumps(WALK | {"attribution": [1, 2]})),
    "decoder walk decode steps text": ("report", WALK_FILE, json.dumps(WALK | {"decode_steps": "<script>"})),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_beside_a_report_is_a_note(case: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. Malformed nightly results, map summaries, studies, maps and decoder
    walks: the page is written without them (exit 0) and says which file and field in one line,
    on the page and on stderr (no control character); never a traceback."""
    where, name, text = MALFORMED[case]
    report_dir = _checkout(tmp_path)
    maps = tmp_path / "maps"
    maps.mkdir()
    (report_dir if where == "report" else maps).joinpath(name).write_text(text)
    assert main(["report", "render", str(report_dir), "--maps", str(maps)]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert name in line and "not shown" in line and "Traceback" not in line and not invisible(line), line
    assert name in (report_dir / "report.html").read_text().split("Not shown", 1)[1]


@pytest.mark.parametrize("kind", ["symlink", "FIFO", "folder"])
def test_a_decoder_walk_that_is_not_a_regular_file_is_refused(kind: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. ``decoder_walk.json`` beside a report is read like ``nightly.json``: a
    symlink (to a credentials file), a FIFO or a folder is named under "Not shown", never followed,
    never waited on."""
    report_dir = _checkout(tmp_path)
    (tmp_path / "maps").mkdir()
    walk = report_dir / WALK_FILE
    if kind == "symlink":
        walk.symlink_to(tmp_path / "credentials.json")
    elif kind == "FIFO":
        os.mkfifo(walk)
    else:
        walk.mkdir()
    with _deadline(60):
        assert main(["report", "render", str(report_dir), "--maps", str(tmp_path / "maps")]) == 0
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert WALK_FILE in line and "not shown" in line, line
    assert SECRET not in _rendered(report_dir) + captured.out + captured.err
    assert WALK_FILE in (report_dir / "report.html").read_text().split("Not shown", 1)[1]


def test_a_study_of_another_shape_still_shows_as_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. A study whose numbers cannot be drawn (text layers, text among the
    numbers) is shown as data with a "not drawn" note. (A number beyond a double's range is not
    JSON k3verify reads: such a file is named under "Not shown", see the malformed files below.)"""
    report_dir = _checkout(tmp_path)
    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / STUDY_NAME).write_text(json.dumps({"title": "$^$", "layers": ["a", "b"], "error_x": [1, 2]}))
    (maps / "moe_routing_flips.json").write_text('{"a": [1, 2], "b": ["text", 1]}')
    assert main(["report", "render", str(report_dir), "--maps", str(maps)]) == 0
    assert capsys.readouterr().err == ""
    page = (report_dir / "report.html").read_text()
    assert "not drawn: &#x27;layers&#x27; is not a list of numbers" in page and "moe_routing_flips.json" in page


@fuzz
@given(offset=st.integers(0, 10**6), bits=st.integers(1, 255), cut=st.integers(0, 10**6))
def test_fuzzed_png_bytes_decode_or_are_refused(offset: int, bits: int, cut: int) -> None:
    """Rule: structural. Bytes of a map PNG flipped or cut: :func:`plots.compact_png` returns a
    PNG or raises ``ValueError`` saying why, nothing else."""
    data = bytearray(_png(40, 30))
    data[offset % len(data)] ^= bits
    data = bytes(data[: max(8, cut % (len(data) + 1))])
    try:
        out = plots.compact_png(data)
    except ValueError as exc:
        assert str(exc)
    else:
        assert out.startswith(b"\x89PNG")


# --- paths that look like rich markup -----------------------------------------------------------------


def test_paths_with_brackets_print_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: structural. ``report render 'D[/]x'`` and ``golden generate --dir 'g[/]x'`` name
    their paths as given (rich would read ``[/]`` as a closing tag and stop with an error)."""
    report_dir = tmp_path / "D[/]x"  # to rich, "[/]" closes a tag
    report_dir.mkdir(parents=True)
    (report_dir / "report.json").write_text(json.dumps(_small_report()))
    (tmp_path / "maps").mkdir()
    assert main(["report", "render", str(report_dir), "--maps", str(tmp_path / "maps")]) == 0
    assert f"wrote {report_dir / 'report.md'}" in capsys.readouterr().out

    def generate(out_dir: Path, *, progress: Any = None, **kwargs: Any) -> dict[str, Any]:
        progress("mla/[bold]default")
        return {"files": {"mla/[/]default.safetensors": {"bytes": 1000, "tensors": {}}}}

    monkeypatch.setattr(golden, "generate", generate)
    folder = tmp_path / "g[/]x"
    assert main(["golden", "generate", "--dir", str(folder)]) == 0
    captured = capsys.readouterr()
    assert "mla/[/]default.safetensors: 1 kB" in captured.out and f"{folder / 'manifest.json'}" in captured.out
    assert "mla/[bold]default" in captured.err
