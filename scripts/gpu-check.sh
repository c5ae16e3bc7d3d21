#!/usr/bin/env bash
# The GPU check of docs/gpu.md, in two halves, because the machine with the GPU may have no
# build dependencies (nothing can be fetched there) while this one has no GPU:
#
#   scripts/gpu-check.sh --pack [DIR]   here: builds device_gpu_test and hxfer-gpu-check with
#                                       CUDA (build-gpu/), copies them and the shared
#                                       libraries they need besides glibc (xxhash, and for the
#                                       transport OpenSSL's libcrypto and UCX) into DIR
#                                       (default .gpu-check, ignored by git: carry it)
#   scripts/gpu-check.sh --run [DIR]    there: probes the GPU, runs the GPU tests and the check,
#                                       prints the table and "N passed, N failed"
#   scripts/gpu-check.sh                both, on a machine that has a GPU and the dependencies
#
# The binaries link C++'s runtime statically and need glibc 2.34 or later. Without a GPU the
# run says so and exits 2. A run takes one to two minutes on one H100 or H200.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-both}
dir=${2:-.gpu-check}

pack() {
  bash scripts/install-deps.sh
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DHXFER_WITH_CUDA=ON \
    -DHXFER_BUILD_PYTHON=OFF -DHXFER_BUILD_CLI=OFF >/dev/null
  cmake --build build-gpu --target device_gpu_test hxfer-gpu-check
  rm -rf "$dir" && mkdir -p "$dir"
  cp build-gpu/src/device/device_gpu_test build-gpu/src/device/hxfer-gpu-check "$dir/"
  for lib in $(ldd "$dir/hxfer-gpu-check" "$dir/device_gpu_test" | awk '/=> \// {print $3}' |
               sort -u); do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*) ;;  # glibc: the host's
      *) cp -L "$lib" "$dir/" ;;
    esac
  done
  echo "gpu-check: packed into $dir: $(ls "$dir" | tr '\n' ' ')"
}

run() {
  [[ -x "$dir/hxfer-gpu-check" ]] || { echo "gpu-check: no $dir/hxfer-gpu-check (run --pack)"; exit 1; }
  export LD_LIBRARY_PATH="$PWD/$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
    echo "gpu-check: nvidia-smi found no GPU"
  tests_failed=0
  "$dir/device_gpu_test" --gtest_brief=1 || tests_failed=1
  check_rc=0
  "$dir/hxfer-gpu-check" || check_rc=$?
  if [[ $check_rc -eq 2 ]]; then exit 2; fi
  echo "gpu-check: GPU tests $([[ $tests_failed -eq 0 ]] && echo passed || echo FAILED)"
  [[ $tests_failed -eq 0 && $check_rc -eq 0 ]]
}

case "$mode" in
  --pack) pack ;;
  --run) run ;;
  both) pack; run ;;
  *) echo "usage: scripts/gpu-check.sh [--pack [DIR] | --run [DIR]]"; exit 64 ;;
esac
