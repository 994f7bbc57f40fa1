"""Prints each benchmark's speed as a ratio against the peer it names (``extra_info['peer']``),
both measured in the same process and session: the ratio of medians, with each side's
interquartile range relative to its median, so a noisy machine shows as a wide spread."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    by_name = {b.name: b for b in session.benchmarks}
    lines = []
    for b in session.benchmarks:
        peer = b.extra_info.get("peer")
        if peer and peer in by_name:
            mine, theirs = b.stats, by_name[peer].stats
            lines.append(
                f"{b.name}: median {mine.median:.3f} s (IQR {mine.iqr / mine.median:.0%}, {mine.rounds} rounds) vs "
                f"{peer}: {theirs.median:.3f} s (IQR {theirs.iqr / theirs.median:.0%}) "
                f"-> {theirs.median / mine.median:.2f}x the peer's speed"
            )
    if lines:
        terminalreporter.section("speed ratios")
        for line in lines:
            terminalreporter.write_line(line)
