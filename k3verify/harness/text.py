"""Text from reports, maps, studies and plugins, made safe for the place it is shown.

A report is untrusted input: a CI artifact of someone's pull request, whose strings (a row's
reason is a plugin's exception text) may hold markup, control characters or both. Every string
k3verify did not write itself goes through the escaper of its sink, one per sink:

- :func:`html_text` for ``report.html`` (text and attribute values),
- :func:`md_text` for Markdown: ``report.md`` and ``report compare --format md`` (inline places
  only: table cells, paragraphs, list items; never the start of a line),
- :func:`terminal_text` for what the command prints,
- :func:`plot_text` for labels and titles drawn by matplotlib.

Each first makes the invisible visible: control characters (C0 but the newline where a sink
keeps lines, DEL, C1), format characters (bidi overrides and isolates, zero-width ones, the byte
order mark), line and paragraph separators and lone surrogates become ``\\xNN``, ``\\uNNNN`` or
``\\UNNNNNNNN``. A terminal escape sequence then prints as text instead of clearing the screen,
writing the clipboard or hiding a link; a bidi override cannot reorder what a reader sees; and
a lone surrogate cannot stop a page from being written as UTF-8.
"""

from __future__ import annotations

import html
import re
import unicodedata

# Control, format, surrogate, line and paragraph separator characters: none prints as itself.
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# ASCII punctuation that CommonMark or GitHub's Markdown reads as inline syntax: escapes, code
# spans, emphasis, links and images, strikethrough, table cells, math and headings. ``& < >``
# become entities instead (raw HTML, autolinks and entities).
_MD_SYNTAX = frozenset("\\`*_[]!~|$#")
_MD_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
# Plain text that GitHub makes active where it shows Markdown (a pull-request comment, a step
# summary): ``@name`` notifies a user or team, ``:name:`` draws an emoji (a failing row could
# show a check mark), ``#12`` links an issue and leaves a cross-reference on it, a scheme or
# ``www.`` makes a link (a plugin's text would read as the job's). Backslashes do not stop these:
# GitHub finds them in the rendered text. A zero-width space after the ``@``, ``:`` or ``#``, or
# between ``www`` and its dot, breaks each pattern and shows nothing; it is written as the
# entity ``&#8203;``, so the Markdown source stays free of invisible characters.
_GITHUB_ACTIVE = re.compile(r"(?<=[@#:])(?=[\w/+-])|(?<=www)(?=\.)", re.IGNORECASE)
_BREAK = "&#8203;"
# The longest label a figure draws (legends and tick labels of reports run to about 90).
PLOT_TEXT_LIMIT = 160


def _escaped(ch: str) -> str:
    """``ch`` spelled as a Python escape: ``\\x1b``, ``\\u202e``, ``\\U000e0001``."""
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def visible(value: object, keep: str = "") -> str:
    """``str(value)`` with every character that does not print as itself written as an escape
    (see the module docstring); characters in ``keep`` (say ``"\\n"``) stay as they are."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case: nothing invisible (every such character is unprintable)
        return text
    return "".join(_escaped(ch) if ch not in keep and unicodedata.category(ch) in _INVISIBLE else ch for ch in text)


def html_text(value: object) -> str:
    """``value`` as HTML text or a quoted attribute value: visible, with ``& < > " '`` as
    character references. Newlines and tabs stay (whitespace to HTML, lines in a ``<pre>``)."""
    return html.escape(visible(value, keep="\n\t"), quote=True)


def md_text(value: object) -> str:
    """``value`` as inline Markdown that reads as the text itself: line breaks and tabs as
    spaces (a newline could start a heading or end a table row), the rest visible, ``& < >`` as
    entities, every other syntax character backslash-escaped, and GitHub's mentions, emoji
    codes, issue references and bare links broken by a zero-width space.

    For inline places only (a table cell, or after other text on a line), and never inside a
    code span, where a backslash does not escape."""
    text = value if isinstance(value, str) else str(value)
    text = visible(text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ").replace("\t", " "))
    text = "".join(_MD_ENTITIES.get(ch) or (f"\\{ch}" if ch in _MD_SYNTAX else ch) for ch in text)
    return _GITHUB_ACTIVE.sub(_BREAK, text)


def terminal_text(value: object, *, newlines: bool = False) -> str:
    """``value`` for a terminal or a log: visible, so no escape sequence reaches the terminal;
    newlines stay only when ``newlines`` (a caller that prints several lines). Print it with
    rich's markup off (``markup=False``, or as a ``Text``), so brackets stay text too."""
    return visible(value, keep="\n" if newlines else "")


def plot_text(value: object, limit: int = PLOT_TEXT_LIMIT) -> str:
    """``value`` for one line of a matplotlib label or title: visible (a newline too), at most
    ``limit`` characters (a longer text is cut, with ``…``: a figure grows with its labels), and
    with every ``$`` escaped so that nothing is parsed as mathtext (``$^$`` would stop the
    figure from drawing)."""
    text = visible(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("$", r"\$")
