"""Where a kernel's warps wait, instruction by instruction, from an Nsight Compute source page (CSV):

    ncu --section WarpStateStats --section SourceCounters -o /tmp/rep python3 ...      (on the GPU machine)
    ncu --import /tmp/rep.ncu-rep -k _fwd_scan --page source --print-source sass --csv > fwd_scan.csv
    python3 benchmarks/ncu_hotspots.py fwd_scan.csv [--top 15]

Prints the stall reasons over all samples, the share of samples per opcode, the local-memory (spilled registers)
against global L2 sectors, and the instructions where most samples fell with their main reasons. A load issued
right before its use shows up as the first instruction that consumes it waiting on `long_sb`. benchmarks/ncu_scans.sh
writes these CSVs (SOURCE=1).
"""

from __future__ import annotations

import argparse
import collections
import csv


def sections(path: str):
    """One (header, rows) per profiled launch: a CSV holds one section per launch of the kernel."""
    rows = list(csv.reader(open(path)))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    for a, b in zip(starts, starts[1:]):
        header = rows[a + 1]
        yield rows[a][1], header, [r for r in rows[a + 2:b] if len(r) >= len(header)]


def number(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def report(name: str, header: list, rows: list, top: int):
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(r[col["Warp Stall Sampling (All Samples)"]]) for r in rows]
    total = sum(samples) or 1.0
    by_reason = collections.Counter({h[6:]: sum(number(r[col[h]]) for r in rows) for h in reasons})
    by_op = collections.Counter()
    for r, s in zip(rows, samples):
        words = [w for w in r[col["Source"]].split() if not w.startswith("@")]
        by_op[words[0].split(".")[0] if words else "?"] += s
    sectors = ""
    if "L2 Theoretical Sectors Local" in col:   # with --section MemoryWorkloadAnalysis
        local, glob = (sum(number(r[col[f"L2 Theoretical Sectors {k}"]]) for r in rows) for k in ("Local", "Global"))
        sectors = f"; L2 sectors local {local:.3g} (spilled registers), global {glob:.3g}"
    print(f"\n== {name}: {int(total)} samples, {len(rows)} instructions{sectors}")
    print("reasons: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(8)))
    print("opcodes: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(10)))
    for s, r in sorted(zip(samples, rows), key=lambda x: -x[0])[:top]:
        why = sorted(((number(r[col[h]]), h[6:]) for h in reasons), reverse=True)[:2]
        print(f"  {100 * s / total:5.1f}%  {r[col['Source']].strip()[:64]:64s}  "
              + ", ".join(f"{w} {int(n)}" for n, w in why if n))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv", nargs="+")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    for path in args.csv:
        for name, header, rows in sections(path):
            report(name, header, rows, args.top)


if __name__ == "__main__":
    main()
