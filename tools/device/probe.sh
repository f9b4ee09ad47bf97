#!/usr/bin/env bash
# What the GPU machine's image offers for building kestrel (printed, nothing changed).
set -u
cat /etc/os-release | head -3; uname -m; nproc
for c in g++ gcc c++ clang++ cmake ninja make pkg-config nvcc node npm compute-sanitizer ncu; do
  printf '%-18s %s\n' "$c" "$(command -v $c 2>/dev/null) $($c --version 2>/dev/null | head -1)"; done
ldd --version | head -1
for h in nlohmann/json.hpp fmt/format.h spdlog/spdlog.h CLI/CLI.hpp pcre2.h utf8proc.h httplib.h gtest/gtest.h benchmark/benchmark.h openssl/ssl.h zlib.h; do
  f=$(ls /usr/include/$h /usr/local/include/$h 2>/dev/null | head -1); printf '%-24s %s\n' "$h" "${f:-MISSING}"; done
ls /usr/src/googletest 2>/dev/null | head -3
python3 -c "import sys; print(sys.version)"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
