#!/usr/bin/env bash
# Builds kestrel (Release, warnings as errors; CUDA sources compile when nvcc is present) and runs
# the CPU test suite with ctest, then the loader tests again under AddressSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
CUDA_FLAG=OFF
if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then
  CUDA_FLAG=ON
  export PATH=/usr/local/cuda/bin:$PATH
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=$CUDA_FLAG
cmake --build build -j"$JOBS"
ctest --test-dir build -L cpu --output-on-failure -j"$JOBS" --timeout 600

# Loader / safetensors / config tests under ASan+UBSan (CPU-only build of the core tests).
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKESTREL_CUDA=OFF -DKESTREL_ASAN=ON
cmake --build build-asan -j"$JOBS" --target test_core
ASAN_OPTIONS=detect_leaks=1 ./build-asan/test_core
