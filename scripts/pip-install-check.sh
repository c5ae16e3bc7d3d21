#!/usr/bin/env bash
# `pip install <repo>` into a throwaway venv, then `import hxfer` there: the package as a user
# gets it, from nothing. Prints the time it took and the size of the wheel pip built.
#
#   scripts/pip-install-check.sh [PYTHON]     (default: python3 on PATH)
#
# Not part of `make test`: pip fetches the build tooling (scikit-build-core, pybind11) and numpy
# from the package index and the library is compiled from scratch, minutes on 2 cores. The C++
# dependencies are the system's (scripts/install-deps.sh). CMAKE_BUILD_PARALLEL_LEVEL bounds the
# compile jobs (default: nproc).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

t0=$(date +%s.%N)
"$python" -m venv "$tmp/venv"
# pip reports the wheel it built ("Created wheel for hxfer: filename=... size=..."): keep it.
PIP_PROGRESS_BAR=off "$tmp/venv/bin/python" -m pip install --no-cache-dir "$root" 2>&1 |
  tee "$tmp/pip.log"
t1=$(date +%s.%N)

# From another directory, so that the repository's python/ cannot be what is imported.
cd "$tmp"
"$tmp/venv/bin/python" - <<'EOF'
import importlib.metadata
import pathlib
import sys

import hxfer

where = pathlib.Path(hxfer.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.prefix).resolve()), f"imported from {where}"
assert importlib.metadata.version("hxfer") == hxfer.__version__
lay = hxfer.Layout.engine("vllm", model="tiny-hybrid", tp=1, num_blocks=4, num_slots=2)
assert lay.pools()
print(f"pip-install-check: import hxfer {hxfer.__version__} from {where.parent}")
EOF

wheel=$(grep -o 'Created wheel for hxfer: filename=[^ ]* size=[0-9]*' "$tmp/pip.log" || true)
awk -v a="$t0" -v b="$t1" -v w="${wheel#Created wheel for hxfer: }" \
  'BEGIN { printf "pip-install-check: pip install took %.1f s (%s)\n", b - a, w }'
