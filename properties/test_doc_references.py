"""The documents' references into the repository's history resolve in it: a figure that names the
commit it was measured at, or a page that says where removed files went, can be checked out.
Tags and branches do not travel with main (a clone of it has neither), so a document cites
commits; a cited commit that is not in main's history says so where it is cited. Rule:
structural.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where the history is cited: the README, docs/, and the reports' READMEs.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "reports").rglob("README.md"))]
REF = re.compile(r"\b(tag|branch) `([^`]+)`")
# A commit id: 7 to 40 hex digits, one of them a letter (decimals such as 0.0005959 are not ids).
COMMIT = re.compile(r"(?<![0-9A-Za-z.])(?=[0-9]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z])")
OUTSIDE = "outside main's history"


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def _history_reason() -> str | None:
    """Why this checkout cannot tell a cited commit from a missing one, or ``None``."""
    if shutil.which("git") is None:
        return "git is not installed"
    shallow = _git("rev-parse", "--is-shallow-repository")
    if shallow.returncode != 0:
        return "not a git checkout (an installed copy)"
    if shallow.stdout.strip() == "true":
        return "a shallow clone lacks the history the documents cite"
    return None


def _sentences(text: str) -> list[str]:
    """``text`` cut at sentence ends (a full stop, semicolon or colon before a space or line end),
    lines joined: a citation and its qualification are told apart by the sentence."""
    return re.split(r"(?<=[.;:])\s+", " ".join(text.split()))


def _citations() -> list[tuple[str, str, str]]:
    """``(document, commit, sentence)`` for every commit id cited."""
    found = []
    for doc in DOCUMENTS:
        for sentence in _sentences(doc.read_text(encoding="utf-8")):
            found += [(str(doc.relative_to(ROOT)), c, sentence) for c in COMMIT.findall(sentence)]
    return found


def test_documents_cite_no_tag_or_branch() -> None:
    """A tag or branch named in a document would be missing from every clone of main."""
    refs = [(str(doc.relative_to(ROOT)), f"{kind} {name}") for doc in DOCUMENTS
            for kind, name in REF.findall(" ".join(doc.read_text(encoding="utf-8").split()))]  # fmt: skip
    assert refs == [], refs


def test_a_reference_to_a_tag_is_found() -> None:
    """The plant: the sentence the documents used to have."""
    assert REF.findall("outputs are on the tag `lab-attnres-phase1` (`git show`") == [("tag", "lab-attnres-phase1")]


@pytest.mark.skipif(_history_reason() is not None, reason=str(_history_reason()))
def test_every_cited_commit_is_in_the_history_or_says_it_is_not() -> None:
    """Each commit id a document cites is an ancestor of HEAD, or its sentence says it is
    outside main's history (a measuring commit that was not kept). The plant, a made-up id in a
    sentence of its own, is named."""
    head = _git("rev-parse", "HEAD").stdout.strip()

    def missing(cited: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
        out = []
        for doc, commit, sentence in cited:
            known = _git("merge-base", "--is-ancestor", commit, head).returncode == 0
            if not known and OUTSIDE not in sentence:
                out.append((doc, commit))
        return out

    cited = _citations()
    assert len(cited) > 50  # the documents cite their measured commits: a pattern that finds none is broken
    assert missing(cited) == []
    plant = [("docs/gpu.md", "c0ffee1", "Measured at c0ffee1 on an H100.")]
    assert missing(plant) == [("docs/gpu.md", "c0ffee1")]
    assert missing([("docs/gpu.md", "c0ffee1", f"At c0ffee1 (a measuring commit {OUTSIDE}).")]) == []
