#!/usr/bin/env bash
# The gateway's REST API with nothing but curl: health, models, a streamed /generate (NDJSON),
# an OpenAI chat completion, and speech saved as a WAV file.
#
#   examples/curl.sh [GATEWAY_URL] [OUT_DIR]     (defaults: http://127.0.0.1:8000, a new temp dir)
#
# Start a mesh first: `mstar serve toy`. A mesh with API keys: export MSTAR_API_KEY=<key> first.
set -euo pipefail
URL=${1:-http://127.0.0.1:8000}
OUT=${2:-$(mktemp -d)}
CURL=(curl -sS --fail-with-body --max-time 30)
if [ -n "${MSTAR_API_KEY:-}" ]; then CURL+=(-H "Authorization: Bearer $MSTAR_API_KEY"); fi
JSON=(-H 'content-type: application/json')

echo "== GET /health"
"${CURL[@]}" "$URL/health"; echo

echo "== GET /v1/models"
"${CURL[@]}" "$URL/v1/models"; echo

echo "== POST /generate (stream: NDJSON, one line per chunk; base64 payloads shortened here)"
"${CURL[@]}" -N "${JSON[@]}" "$URL/generate" \
  -d '{"model": "toy", "text": "Hello, World.", "stream": true, "model_kwargs": {"max_tokens": 64}}' |
  sed -E 's/"data_b64":"([^"]{12})[^"]*"/"data_b64":"\1..."/' 

echo "== POST /v1/chat/completions"
"${CURL[@]}" "${JSON[@]}" "$URL/v1/chat/completions" \
  -d '{"model": "toy", "messages": [{"role": "user", "content": "Hello, World."}], "max_tokens": 64}'; echo

echo "== POST /v1/chat/completions (stream: SSE)"
"${CURL[@]}" -N "${JSON[@]}" "$URL/v1/chat/completions" \
  -d '{"model": "toy", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'

echo "== POST /v1/audio/speech -> $OUT/speech.wav"
"${CURL[@]}" "${JSON[@]}" "$URL/v1/audio/speech" -o "$OUT/speech.wav" \
  -d '{"model": "toy", "input": "Hello, World.", "response_format": "wav"}'
echo "wrote $(wc -c < "$OUT/speech.wav") bytes to $OUT/speech.wav"

echo "== an error names the field"
"${CURL[@]}" "${JSON[@]}" "$URL/generate" -d '{"model": "toy", "text": "hi", "model_kwargs": {"max_tokens": 0}}' || true
echo
