"""benchmarks/ncu_hotspots.py reads Nsight Compute's per-instruction source CSV (one section per profiled launch)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_hotspots_rank_instructions_and_reasons(tmp_path):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "stall_wait",
              "stall_long_sb (Not Issued)", "L2 Theoretical Sectors Local", "L2 Theoretical Sectors Global"]
    body = [["0x10", "STS [R9+0x4000], R32", "75", "70", "5", "70", "0", "0"],
            ["0x20", "@P0 LDG.E.128 R32, desc[UR6][R2.64]", "25", "0", "25", "0", "4", "12"]]
    section = [["Kernel Name", "_fwd_scan", ""], header, *body]
    csv = tmp_path / "src.csv"
    csv.write_text("\n".join(",".join(f'"{x}"' for x in row) for row in section * 2) + "\n")   # two launches
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ncu_hotspots.py"), str(csv), "--top", "1"],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("== _fwd_scan: 100 samples, 2 instructions; L2 sectors local 4") == 2
    assert "reasons: long_sb 70.0%, wait 30.0%" in out
    assert "opcodes: STS 75.0%, LDG 25.0%" in out
    hot = [line for line in out.splitlines() if line.startswith("   ")]
    assert len(hot) == 2 and all("75.0%  STS [R9+0x4000], R32" in line and "long_sb 70, wait 5" in line
                                  for line in hot)
