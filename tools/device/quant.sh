#!/usr/bin/env bash
# GPU machine (no GPU needed): the MLX-layout 4-bit copy of the tiny fixture, the transformers fp32
# reference logits of its dequantised weights, and the quantizer-parity vectors.
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
rm -rf tests/fixtures/tiny-mlx4 tests/fixtures/quant/parity.safetensors
time python3 tools/make_mlx_fixture.py --src tests/fixtures/tiny --out tests/fixtures/tiny-mlx4 \
  --parity tests/fixtures/quant/parity.safetensors --reference
ls -la tests/fixtures/tiny-mlx4 tests/fixtures/quant
sha256sum tests/fixtures/tiny-mlx4/* tests/fixtures/quant/*
tar czf "$OUT/quant.tar.gz" tests/fixtures/tiny-mlx4 tests/fixtures/quant
