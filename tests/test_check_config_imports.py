"""scripts/launch.sh checks the config (flame.check_config) before every run: that check imports neither torch nor
Triton (on a 2-core machine importing torch is ~3 CPU-seconds of each launch)."""

import json
import subprocess
import sys

from tests.helpers import REPO, env

# Every config as launch.sh checks it, the head sizes the kernels refuse (their limits, from kernels/limits.py) and
# context parallelism's checks, all in one process; it prints each exit code and the heavy modules it imported.
CHECK_ALL = """
import contextlib, io, json, sys
from flame.check_config import main

codes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
            codes.append(0)
        except SystemExit as e:
            codes.append(e.code)
print(json.dumps({"codes": codes, "imported": [m for m in ("torch", "triton") if m in sys.modules]}))
"""


def test_check_config_imports_no_torch():
    configs = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.toml"))
    cases = [["--config", c, "--strict", "--world-size", "2", "--get", "job.dump_folder"] for c in configs]
    cases += [["--config", "configs/rwkv7_0.6B.toml", "--model.head_dim=256", "--no-data-check"],
              ["--config", "configs/rwkv6_1.5B.toml", "--model.head_dim=512", "--no-data-check"],
              ["--config", "configs/gsa_tiny.toml", "--model.num_slots=512"]]
    cp2 = ["--world-size", "2", "--parallelism.context_parallel_degree=2"]
    cases += [["--config", "configs/rwkv7_tiny.toml", *cp2],
              ["--config", "configs/rwkv7_tiny.toml", *cp2, "--training.seq_len=192"],
              ["--config", "configs/transformer_tiny.toml", *cp2]]
    proc = subprocess.run([sys.executable, "-c", CHECK_ALL, json.dumps(cases)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["imported"] == []
    # the tiny configs read the bundled sample; the others name cluster paths (a data error under --strict)
    assert result["codes"] == [0 if c.endswith("_tiny.toml") else 2 for c in configs] + [2, 2, 2, 0, 2, 2]
