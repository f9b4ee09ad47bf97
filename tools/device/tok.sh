#!/usr/bin/env bash
# tok: tokenizer + chat-template parity fixtures from HF tokenizers/transformers (GPU machine, offline).
# Needs tools/tokenizer/tmp_qwen3_tokenizer.json.gz (an untracked copy of the npm Qwen3 tokenizer.json).
# Produces $OUT/tok.tar.gz with tests/fixtures/tokenizer/{expected_*,decode_*,chat_*,hf_meta}.*
set -euo pipefail
export PYTHONUNBUFFERED=1
FX=tests/fixtures/tokenizer
python3 -c "import tokenizers, transformers, jinja2; print('tokenizers', tokenizers.__version__, 'transformers', transformers.__version__, 'jinja2', jinja2.__version__)"
# transformers' own apply_chat_template on the tiny tokenizer dir (cross-check of tests/chat/render_jinja.py)
python3 tests/chat/render_jinja.py tests/fixtures/tiny/chat_template.jinja $FX/conversations.json $FX/chat_jinja_device.json.gz
python3 tests/chat/render_jinja.py tests/fixtures/tiny/chat_template.jinja $FX/conversations.json \
  $FX/chat_transformers.json.gz --transformers tests/fixtures/tiny || \
  echo '{"transformers_failed": true}' | gzip > $FX/chat_transformers.json.gz
python3 tools/tokenizer/hf_expected.py $FX/corpus.jsonl.gz tools/tokenizer/tmp_qwen3_tokenizer.json.gz \
  $FX/chat_jinja_device.json.gz $FX
tar czf "$OUT/tok.tar.gz" $FX/expected_*.jsonl.gz $FX/decode_*.json $FX/chat_ids_tiny.json.gz \
  $FX/chat_transformers.json.gz $FX/chat_jinja_device.json.gz $FX/hf_meta.json
ls -la $FX
