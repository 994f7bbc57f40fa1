"""Prints each benchmark's speed as a ratio against the peer it names (``extra_info['peer']``),
both measured in the same process and session."""

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
            mine, theirs = b.stats.min, by_name[peer].stats.min
            lines.append(
                f"{b.name}: {mine:.3f} s (min of {b.stats.rounds}) vs {peer}: {theirs:.3f} s "
                f"-> {theirs / mine:.2f}x the peer's speed"
            )
    if lines:
        terminalreporter.section("speed ratios")
        for line in lines:
            terminalreporter.write_line(line)
