#!/usr/bin/env bash
# Installs what flame needs on this machine; quick and harmless when everything is already there.
# torch comes first and only when missing: on a machine without a GPU the CPU build (torch==2.13.0); a plain
# "torch" requirement resolved by pip there would download several GB of CUDA build.
# A failed install stops here with one line naming what is missing: otherwise the tests that need FLA or lm-eval
# would skip and CI would pass without them.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    "$py" -m pip install -q torch==2.13.0
  fi
fi

# Prints, comma-separated, the requirements of pyproject.toml (dependencies and the test extras) this Python does not
# meet, and "flame" when it is not installed (editable) from this folder; prints nothing when all are met.
# -P: "import flame" must not find this folder through the current directory.
unmet() {
  "$py" -P - <<'EOF'
import importlib.metadata, pathlib, tomllib
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare Python: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
unmet = []
for line in project["dependencies"] + project["optional-dependencies"]["test"]:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or not req.specifier.contains(version, prereleases=True):
        unmet.append(line)
try:
    import flame
    here = pathlib.Path(flame.__file__).resolve().is_relative_to(pathlib.Path.cwd().resolve())
except ImportError:
    here = False
if not here:
    unmet.append("flame (editable, from this folder)")
print(", ".join(unmet))
EOF
}

missing=$(unmet) || missing="(pyproject.toml's requirements could not be checked)"
if [ -n "$missing" ]; then
  # pip's own messages pass through, less its notices about the root user and ignored locations
  pip_rc=0
  "$py" -m pip install -q -e ".[test]" 2>&1 \
    | { grep -vE "Location .* is ignored|Running pip as the 'root' user" >&2 || true; } || pip_rc=$?
  missing=$(unmet) || missing="(pyproject.toml's requirements could not be checked)"
  if [ -n "$missing" ]; then
    echo "setup.sh: not installed: $missing (pip exit status $pip_rc)" >&2
    exit 1
  fi
  if [ "$pip_rc" -ne 0 ]; then
    echo "setup.sh: pip install -e '.[test]' failed with exit status $pip_rc" >&2
    exit 1
  fi
fi
"$py" -c "import flame, torch, triton, torchtitan, datasets, tokenizers" \
  || { echo "setup.sh: install incomplete: flame, torch, triton, torchtitan, datasets or tokenizers does not import" >&2; exit 1; }
