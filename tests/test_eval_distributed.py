"""flame.eval on 2 CPU processes (gloo) through `scripts/launch.sh -m flame.eval` against the same evaluation in one
process: the ranks split the windows, so tokens and bytes must be equal and the loss equal up to fp32 batching. The
split at --max-tokens and the bad input run as two forked ranks (tests.helpers.run_script): the launcher's part is the
same."""

from __future__ import annotations

import math
import subprocess

import pytest

from flame.eval import main
from tests.eval_export import DOCS, SEQ_LEN, parse, tiny_eval_export
from tests.helpers import REPO, env, run_script


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_eval_export(tmp_path_factory.mktemp("eval"))


def two_processes(export, data, *extra, launcher=True, cwd=REPO) -> subprocess.CompletedProcess:
    """flame.eval on 2 ranks: through the launcher (run from `cwd`), or (launcher=False) as ranks forked from the
    test's train_forks server, which run flame.eval's main as `python -m flame.eval` does."""
    args = [str(export), "--data", str(data), "--seq-len", str(SEQ_LEN), "--batch-size", "2", "--device", "cpu", *extra]
    if not launcher:
        return run_script("from flame.eval import main; main()", *args, nproc=2, timeout=180)
    return subprocess.run(["bash", str(REPO / "scripts/launch.sh"), "-m", "flame.eval", *args], capture_output=True,
                          text=True, cwd=cwd, env=env(extra=dict(NPROC="2")), timeout=180)


@pytest.mark.parametrize("cut", [False, True], ids=["all", "max-tokens"])
def test_two_ranks_equal_one(setup, capsys, tmp_path, cut):
    base, export, data, tok, model = setup
    # --max-tokens inside document 1, as in test_eval
    extra = ["--max-tokens", str(len(tok.encode(DOCS[0], add_special_tokens=False).ids) + 1 + 5)] if cut else []
    main([str(export), "--data", str(data), "--seq-len", str(SEQ_LEN), "--batch-size", "2", "--device", "cpu",
          *extra])
    single = parse(capsys.readouterr().out)
    assert math.ceil(single["tokens"] / SEQ_LEN) >= 3  # windows for both ranks, one rank with two
    # through the launcher from another folder than the repository's (`-m` finds flame on PYTHONPATH)
    r = two_processes(export, data, *extra, launcher=not cut, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len(r.stdout.splitlines()) == 5, r.stdout  # rank 0 alone prints
    double = parse(r.stdout)
    assert double["tokens"] == single["tokens"] and double["bytes"] == single["bytes"]
    for key in ("loss", "perplexity", "bits_per_byte"):
        assert double[key] == pytest.approx(single[key], rel=1e-6), key


def test_bad_input_is_one_line_from_rank_0(setup, tmp_path):
    base, export, data, tok, model = setup
    r = two_processes(tmp_path / "nope", data, launcher=False)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "nope" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
