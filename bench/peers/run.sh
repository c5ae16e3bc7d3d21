#!/usr/bin/env bash
# hxfer and its peers on the same requests (bench/peers/peers.py --help). Builds hxfer's
# Python module if it is missing and creates the peers' venv (setup.sh) on first use.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${HXFER_BUILD_DIR:-$root/build}"
if ! compgen -G "$build/python/hxfer/_hxfer*.so" >/dev/null; then
  echo "building hxfer's Python module in $build" >&2
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >&2
  cmake --build "$build" --target hxfer_python >&2
fi
[[ -x "$here/.venv/bin/python" ]] || "$here/setup.sh"
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$here/.venv/bin/python" "$here/peers.py" "$@"
