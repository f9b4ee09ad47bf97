# Sourced on the GPU machine (Ubuntu 24.04 image): it has nlohmann-json, fmt, spdlog, CLI11,
# GoogleTest and Google Benchmark, but not PCRE2, utf8proc or cpp-httplib. Those travel as Debian
# packages in .devdeps/ (fetched here with tools/device/fetch_deps.sh; carry ".devdeps" in the run)
# and are unpacked into /tmp/devroot.
if [ -d .devdeps ] && [ ! -d /tmp/devroot ]; then
  mkdir -p /tmp/devroot
  for f in .devdeps/*.deb; do dpkg -x "$f" /tmp/devroot; done
  for pc in /tmp/devroot/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
    sed -i 's#=/usr#=/tmp/devroot/usr#g' "$pc"
  done
fi
export PKG_CONFIG_PATH=/tmp/devroot/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export CPATH=/tmp/devroot/usr/include${CPATH:+:$CPATH}
export LIBRARY_PATH=/tmp/devroot/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
export LD_LIBRARY_PATH=/tmp/devroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=/usr/local/cuda/bin:$PATH
