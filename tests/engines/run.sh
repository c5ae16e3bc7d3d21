#!/usr/bin/env bash
# The engine conformance check: builds its venv (setup.sh, a no-op when up to date), then runs
# conformance.py against the hxfer Python module of build/python (or one installed in the venv).
# Arguments go to conformance.py (--json PATH, --engines, --models, --tp, -v).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${HXFER_ENGINES_VENV:-$ROOT/build/engines-venv}
bash "$ROOT/tests/engines/setup.sh"
if compgen -G "$ROOT/build/python/hxfer*.so" >/dev/null; then
  export PYTHONPATH="$ROOT/build/python${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$VENV/bin/python" "$ROOT/tests/engines/conformance.py" "$@"
