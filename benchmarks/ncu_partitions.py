"""Where each warp partition of a warp-specialised kernel spends its time, from Nsight Compute.

    ncu --set full --import-source yes -o PROFILE python3 ...        # on the GPU machine
    ncu --import PROFILE.ncu-rep --page source --csv --print-source sass > PROFILE.sass.csv
    python benchmarks/ncu_partitions.py PROFILE.sass.csv [--top 6]

The source page lists every SASS instruction with its warp-stall samples and executions. A
warp-specialised kernel (Triton's ``warp_specialize``) gives each partition its register budget
with ``setmaxnreg`` on entry, so those instructions split the listing into the partitions' code.
For each part holding at least 0.5% of the samples this prints its share of the samples, its
instructions executed, its commonest opcodes, its stall reasons and its most sampled
instructions (with the reasons that make up more than 30% of each).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from itertools import pairwise


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(source: str) -> str:
    """``@!P0 BRA.U 0x..`` -> ``BRA``."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def partitions(path: str) -> tuple[list[str], list[list[str]], list[tuple[int, int]]]:
    """The header, the instruction rows and the ``[start, end)`` row spans between ``setmaxnreg``
    instructions of a source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]  # row 0 names the kernel
    source = header.index("Source")
    cuts = [i for i, r in enumerate(data) if "SETMAXREG" in r[source]]
    bounds = [0, *cuts, len(data)]
    return header, data, list(pairwise(bounds))


def report(path: str, top: int = 6) -> str:
    """The per-partition summary of one source-page CSV, as text."""
    header, data, spans = partitions(path)
    source = header.index("Source")
    samples = header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed")
    reasons = [(h[len("stall_"):], header.index(h)) for h in header if h.startswith("stall_") and "Not" not in h]
    total = sum(_number(r[samples]) for r in data) or 1.0
    lines = [f"{path}: {total:.0f} samples, {len(data)} instructions"]
    for start, end in spans:
        part = data[start:end]
        got = sum(_number(r[samples]) for r in part)
        if got < 0.005 * total:
            continue
        ops = Counter()
        for r in part:
            ops[_opcode(r[source])] += _number(r[executed])
        stalls = Counter({name: sum(_number(r[i]) for r in part) for name, i in reasons})
        lines.append(f"[{start}:{end}] {100 * got / total:.1f}% of samples, {sum(ops.values()):.3g} instructions; "
                     + ", ".join(f"{o} {c:.2g}" for o, c in ops.most_common(8)))  # fmt: skip
        lines.append("    stalls: " + ", ".join(f"{n} {100 * c / got:.0f}%" for n, c in stalls.most_common(6)))
        for r in sorted(part, key=lambda r: -_number(r[samples]))[:top]:
            s = _number(r[samples])
            why = [n for n, i in reasons if s and _number(r[i]) > 0.3 * s]
            lines.append(f"      {100 * s / got:5.1f}%  {r[source].strip()[:70]}  {', '.join(why)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="source-page CSV files (ncu --page source --csv --print-source sass)")
    parser.add_argument("--top", type=int, default=6, help="most sampled instructions shown per partition")
    args = parser.parse_args(argv)
    for path in args.csv:
        print(report(path, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
