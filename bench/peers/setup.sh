#!/usr/bin/env bash
# Creates bench/peers/.venv with the peers hxfer is measured against: NIXL (its Python package
# and UCX plugin, built for CUDA 12 but running on host memory without a GPU) and Mooncake
# Transfer Engine (the non-CUDA build). Nothing here is a dependency of hxfer or its tests.
# The venv sees the system's site packages (Debian's numpy); hxfer's module comes from the
# build tree (run.sh sets PYTHONPATH). Versions are pinned so figures can be compared.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
NIXL_PACKAGE="${NIXL_PACKAGE:-nixl-cu12==1.5.1}"
MOONCAKE_PACKAGE="${MOONCAKE_PACKAGE:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
if ! /usr/bin/python3 -c "import venv, ensurepip" 2>/dev/null; then
  echo "installing python3-venv" >&2
  apt-get install -y -qq --no-install-recommends python3-venv >&2
fi
if [[ ! -x "$venv/bin/python" ]]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "$NIXL_PACKAGE" "$MOONCAKE_PACKAGE"
"$venv/bin/python" - <<'PY'
from importlib.metadata import version
import nixl_cu12._api, mooncake.engine  # noqa: F401  (both load)
print("peers ready: nixl-cu12", version("nixl-cu12"), "| mooncake-transfer-engine-non-cuda",
      version("mooncake-transfer-engine-non-cuda"))
PY
