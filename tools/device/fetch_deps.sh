#!/usr/bin/env bash
# Here (Debian 12): downloads the packages the GPU machine's image lacks into .devdeps/ (ignored;
# name it in the run's carry list). See tools/device/env.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .devdeps && cd .devdeps
apt-get download libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libcpp-httplib-dev libcpp-httplib0.11 libbrotli-dev libbrotli1
