#!/usr/bin/env bash
# GPU machine: regenerate the fixtures with transformers (fp32 reference on bf16 weights).
#   tiny:      a tiny random model saved by transformers + its reference
#   realwidth: weights from `kestrel synth-model` (deterministic), reference from transformers
# Run with carry [".devdeps"]; writes $OUT/fixtures.tar.gz (untar at the repo root).
set -euo pipefail
export PYTHONUNBUFFERED=1
source tools/device/env.sh
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
python3 -c "import fla" 2>/dev/null && echo "WARNING: fla installed" || echo "fla not installed (torch fallback = reference)"
files=()
if [ "${FIXTURES_TINY:-0}" = 1 ]; then
  rm -f tests/fixtures/tiny/model.safetensors tests/fixtures/tiny/reference.safetensors
  python3 tools/make_fixtures.py tiny --out tests/fixtures/tiny
  files+=(tests/fixtures/tiny/config.json tests/fixtures/tiny/generation_config.json
          tests/fixtures/tiny/model.safetensors tests/fixtures/tiny/reference.safetensors)
fi
cmake -S . -B /tmp/kbuild -G Ninja -DKESTREL_CUDA=OFF -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF >/tmp/cmake.log 2>&1 || { cat /tmp/cmake.log; exit 1; }
cmake --build /tmp/kbuild -j16 --target kestrel >/tmp/build.log 2>&1 || { tail -50 /tmp/build.log; exit 1; }
/tmp/kbuild/kestrel synth-model --config tests/fixtures/realwidth/config.json --seed 1 --out /tmp/realwidth
python3 tools/make_fixtures.py reference --out /tmp/realwidth --ref-out tests/fixtures/realwidth/reference.safetensors
files+=(tests/fixtures/realwidth/reference.safetensors)
tar czf $OUT/fixtures.tar.gz "${files[@]}"
