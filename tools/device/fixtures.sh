#!/usr/bin/env bash
# GPU machine: regenerate the tiny fixture with transformers (fp32 reference on bf16 weights).
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
python3 -c "import fla" 2>/dev/null && echo "WARNING: fla installed" || echo "fla not installed (torch fallback = reference)"
rm -rf tests/fixtures/tiny/model.safetensors tests/fixtures/tiny/reference.safetensors
python3 tools/make_fixtures.py tiny --out tests/fixtures/tiny
mkdir -p /tmp/refsrc
M=$(python3 -c "import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as m; print(m.__file__)")
cp "$M" /tmp/refsrc/
cp "$(dirname $M)/configuration_qwen3_5_moe.py" /tmp/refsrc/ || true
ls -la tests/fixtures/tiny
tar czf $OUT/fixtures.tar.gz tests/fixtures/tiny/config.json tests/fixtures/tiny/generation_config.json \
  tests/fixtures/tiny/model.safetensors tests/fixtures/tiny/reference.safetensors
tar czf $OUT/refsrc.tar.gz -C /tmp refsrc
