"""The "Decoder walk" section of the report pages, from ``decoder_walk.json`` (``k3verify walk``).

The document (:func:`k3verify.harness.decoder_walk.study_document`) is read when the report is
written (handed over in memory) and when ``report render`` rewrites a folder (the file beside
``report.json``, read like ``nightly.json``: bounded, without following a symlink). It is
untrusted input: :func:`check_walk` refuses a document whose objects and lists are not where
the section expects them (the pages name it under "Not shown"); the values inside may be
anything, and each becomes plain text here (numbers through :func:`~.report.fmt`, other values
cut to :data:`MAX_CELL`), escaped by each sink: :func:`walk_markdown` through ``md_text``,
the page (:mod:`k3verify.harness.render`) through ``html_text``, figures through ``plot_text``.
Long lists are cut to what a table shows, and the cut is said.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .files import UsageError
from .report import _md_table, fmt
from .text import md_text

WALK_FILE = "decoder_walk.json"
# Rows of a table (attribution, job times), plans of the growth table, its per-block columns,
# and the characters of one cell: a document may hold any number of each.
MAX_WALK_ROWS, MAX_WALK_PLANS, MAX_WALK_BLOCKS, MAX_CELL = 40, 8, 12, 120
# Where the document holds an object or a list ("*": every key or item); a part that is missing
# or null is left out of the section, one of another type refuses the document.
SHAPES: tuple[tuple[tuple[str, ...], type], ...] = (
    (("config",), dict), (("seconds",), dict), (("scenarios",), dict), (("scenarios", "*"), dict),
    (("fp64",), dict), (("depth_drift",), dict), (("depth_drift", "sublayers"), list),
    (("depth_drift", "curves"), dict), (("depth_drift", "curves", "*"), list),
    (("depth_drift", "y_curves"), dict), (("depth_drift", "y_curves", "*"), list),
    (("depth_drift", "block_growth"), dict), (("depth_drift", "block_growth", "*"), list),
    (("depth_drift", "growth_per_block"), dict),
    (("decode_steps",), dict), (("decode_steps", "positions"), list), (("decode_steps", "served"), list),
    (("decode_steps", "baseline"), list),
    (("attribution",), list), (("attribution", "*"), dict),
    (("routing_flips",), dict), (("first_divergence",), dict), (("first_divergence", "planted"), dict),
)


def check_walk(doc: Any, path: Path) -> dict[str, Any]:
    """``doc`` if it is an object whose parts have the shapes of :data:`SHAPES`; ``UsageError``
    naming ``path`` and the first part that does not."""
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: decoder walk is a JSON {_json_type(doc)}, not an object")
    for where, kind in SHAPES:
        for name, value in _parts(doc, where):
            if value is not None and not isinstance(value, kind):
                raise UsageError(f"{path}: decoder walk's {name} is a JSON {_json_type(value)}, not "
                                 f"{'an object' if kind is dict else 'a list'}")
    return doc


def _parts(doc: Any, where: tuple[str, ...], name: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of every part of ``doc`` at ``where`` (names of keys cut to 40 characters)."""
    if not where:
        yield name, doc
        return
    head, rest = where[0], where[1:]
    if head == "*":
        items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
        for key, value in items:
            yield from _parts(value, rest, f"{name}[{repr(key)[:40]}]")
    elif isinstance(doc, dict) and head in doc:
        yield from _parts(doc[head], rest, f"{name}.{head}" if name else head)


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def cell(value: Any, spec: str = ".2e") -> str:
    """A value of the document as one table cell: an integer as itself, another number as
    ``fmt`` writes it, a bool as yes or no, anything else as its text; cut to :data:`MAX_CELL`
    characters."""
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int) and abs(value) < 10**15:
        text = str(value)
    elif isinstance(value, (dict, list)):
        text = json.dumps(value)
    else:
        text = fmt(value, spec)
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 1] + "…"


def number(value: Any) -> bool:
    """A number that converts to a finite float (not a bool, not beyond a double's range)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -1e308 <= value <= 1e308


def percent(value: Any) -> str:
    """A fraction as a percentage cell (``-`` when missing; text as given)."""
    return f"{cell(value * 100, '.1f')} %" if number(value) else cell(value)


def _part(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _cut(items: list[Any], limit: int, what: str) -> tuple[list[Any], str]:
    """The first ``limit`` items and, when some were left out, a note saying so."""
    return (items[:limit], f" (the first {limit} of {len(items)} {what})") if len(items) > limit else (items, "")


def describe(doc: dict[str, Any]) -> str:
    """One sentence: the stack's size, the request and the precision walked."""
    cfg, decode = _part(doc, "config"), doc.get("decode")
    steps = "decode step" if decode == 1 and not isinstance(decode, bool) else "decode steps"
    return (f"K3's decoder stack at {cell(cfg.get('num_layers'))} layers (hidden {cell(cfg.get('hidden'))}), "
            f"a prompt of {cell(doc.get('prompt'))} tokens then {cell(decode)} {steps}, "
            f"low precision {cell(doc.get('dtype'))}; every error is an RMS ratio against the fp64 walk "
            "(rms(x − x_fp64) / rms(x_fp64)).")


def fp64_text(doc: dict[str, Any]) -> str | None:
    """The fp64 agreement figure in one sentence (``None`` without it)."""
    fp64 = doc.get("fp64")
    if not isinstance(fp64, dict):
        return None
    return ("The walk of the modules' fp64 chunkwise forms against the walk of their recurrent definitions: "
            f"normwise relative max error {cell(fp64.get('forms_vs_definitions'))} at the final hidden state "
            "(fp64 agreement: at most 1e-10), and "
            f"{cell(fp64.get('worst_h'))} at worst in the residual stream after any sublayer call.")


def growth_table(doc: dict[str, Any]) -> tuple[list[str], list[list[str]], str] | None:
    """The depth drift per plan: growth per block, final error, growth within each block."""
    drift = doc.get("depth_drift")
    if not isinstance(drift, dict):
        return None
    curves, blocks, per = (_part(drift, k) for k in ("curves", "block_growth", "growth_per_block"))
    plans, note = _cut(list(dict.fromkeys([*curves, *blocks, *per])), MAX_WALK_PLANS, "plans")
    if not plans:
        return None
    width = max([len(blocks.get(p) or []) for p in plans])
    if width > MAX_WALK_BLOCKS:
        note += f" (the first {MAX_WALK_BLOCKS} of {width} blocks)"
        width = MAX_WALK_BLOCKS
    header = ["plan", "growth per block", "final error", *(f"block {k + 1}" for k in range(width))]
    rows = []
    for plan in plans:
        curve, growth = curves.get(plan) or [], blocks.get(plan) or []
        rows.append([cell(plan), cell(per.get(plan), ".3f"), cell(curve[-1] if curve else None),
                     *(cell(growth[k], ".3f") if k < len(growth) else "-" for k in range(width))])
    return header, rows, note


def _split(values: list[Any], positions: Any, prompt: Any) -> tuple[list[float], list[float]]:
    """The finite numbers of a decode-step curve at prompt positions and at decode steps (by
    position where ``positions`` gives one number per value, else by index)."""
    at = positions if isinstance(positions, list) and len(positions) == len(values) \
        and all(number(p) for p in positions) else range(len(values))
    cut = prompt if number(prompt) else len(values)
    prompt_part, decode_part = [], []
    for p, v in zip(at, values):
        if number(v):
            (prompt_part if p < cut else decode_part).append(float(v))
    return prompt_part, decode_part


def decode_table(doc: dict[str, Any]) -> list[list[str]] | None:
    """Per curve (served, baseline): the worst error over the prompt's positions, over the decode
    steps, and at the last position."""
    steps = doc.get("decode_steps")
    if not isinstance(steps, dict):
        return None
    rows = []
    for key, what in (("served", "served: prefill, then decode steps"),
                      ("baseline", "baseline: the naive same-dtype definition")):
        values = steps.get(key)
        if not isinstance(values, list):
            continue
        prompt_part, decode_part = _split(values, steps.get("positions"), steps.get("prompt"))
        rows.append([what, cell(max(prompt_part, default=None)), cell(max(decode_part, default=None)),
                     cell(values[-1] if values else None)])
    return rows or None


DECODE_HEADER = ["curve", "worst over the prompt", "worst over the decode steps", "last position"]


def attribution_table(doc: dict[str, Any]) -> tuple[list[list[str]], str] | None:
    """One row per module type in low precision (the rest fp64), all of them, and the variants."""
    table = doc.get("attribution")
    if not isinstance(table, list) or not table:
        return None
    table, note = _cut(table, MAX_WALK_ROWS, "rows")
    return [[cell(a.get("module")), cell(a.get("label")), cell(a.get("out_err")), percent(a.get("share"))]
            for a in table], note


ATTRIBUTION_HEADER = ["module", "plan", "final error", "share"]


def routing_rows(doc: dict[str, Any]) -> list[list[str]] | None:
    flips = doc.get("routing_flips")
    if not isinstance(flips, dict):
        return None
    return [[cell(flips.get("label")), percent(flips.get("fraction")), cell(flips.get("out_err"))]]


ROUTING_HEADER = ["plan", "(token, MoE layer) pairs with another expert set", "final error"]


def divergence_rows(doc: dict[str, Any]) -> list[list[str]] | None:
    found = doc.get("first_divergence")
    if not isinstance(found, dict):
        return None
    planted = _part(found, "planted")
    return [["planted", f"layer {cell(planted.get('layer'))} {cell(planted.get('module'))}"],
            ["found", cell(found.get("found"))],
            ["where", f"sublayer call {cell(found.get('sublayer'))}: layer {cell(found.get('layer'))} "
                      f"{cell(found.get('module'))}"],
            ["sublayer evaluations", cell(found.get("evaluations"))],
            ["description", cell(found.get("description"))]]


def job_rows(doc: dict[str, Any]) -> tuple[list[list[str]], str] | None:
    """Each job's wall time and, for a serving scenario, the sublayer evaluations it took."""
    seconds, scenarios = _part(doc, "seconds"), _part(doc, "scenarios")
    jobs, note = _cut(list(dict.fromkeys([*seconds, *scenarios])), MAX_WALK_ROWS, "jobs")
    if not jobs:
        return None
    return [[cell(job), cell(seconds.get(job), ".1f"), cell(_part(scenarios, job).get("evaluations"))]
            for job in jobs], note


JOB_HEADER = ["job", "seconds", "sublayer evaluations"]
GROWTH_NOTE = ("Growth per block: the geometric mean of the residual stream's error growth per AttnRes "
               "block, from the end of the first block to the last sublayer call; block k: the error at the "
               "block's last sublayer call over its first.")
ATTRIBUTION_NOTE = ("Final error of the walk with one module type in low precision and the rest in fp64 "
                    "(all: every module in low precision; mla fp8 cache: MLA with an fp8 e4m3 latent cache); "
                    "share: its square over the sum of the single-module squares (their quadrature sum).")
ROUTING_NOTE = ("The low-precision walk with the MoE expert choices its own (elsewhere they are pinned to "
                "the fp64 walk's): how often rounding changed them, and the final error that results.")


def walk_markdown(doc: dict[str, Any]) -> list[str]:
    """The section's lines for ``report.md``; every value escaped (``md_text``) here."""
    lines = ["## Decoder walk", "", md_text(f"From {WALK_FILE}: {describe(doc)} report.html draws the curves."), ""]
    fp64 = fp64_text(doc)
    if fp64:
        lines += ["### fp64 agreement", "", md_text(fp64), ""]
    growth = growth_table(doc)
    if growth:
        header, rows, note = growth
        lines += ["### Depth drift", "", md_text(GROWTH_NOTE + note), "", *_md_table(header, rows), ""]
    decode = decode_table(doc)
    if decode:
        lines += ["### Decode steps", "", *_md_table(DECODE_HEADER, decode), ""]
    attribution = attribution_table(doc)
    if attribution:
        rows, note = attribution
        lines += ["### Attribution", "", md_text(ATTRIBUTION_NOTE + note), "", *_md_table(ATTRIBUTION_HEADER, rows),
                  ""]
    routing = routing_rows(doc)
    if routing:
        lines += ["### Routing flips", "", md_text(ROUTING_NOTE), "", *_md_table(ROUTING_HEADER, routing), ""]
    divergence = divergence_rows(doc)
    if divergence:
        lines += ["### First divergence", "", *_md_table(["search", "result"], divergence), ""]
    jobs = job_rows(doc)
    if jobs:
        rows, note = jobs
        lines += ["### Job times", "", *([md_text(note.strip()), ""] if note else []), *_md_table(JOB_HEADER, rows),
                  ""]
    return lines
