#!/usr/bin/env bash
# Install llm-serving into ./.venv (first run only) and start the server in the foreground.
# Any arguments go to `llm-serving start`, e.g. scripts/start.sh --model /path/to/hf-llama --port 8000
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
exec llm-serving start "$@"
