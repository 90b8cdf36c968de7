#!/usr/bin/env bash
# Install llm-serving with its test extras into ./.venv (first run only) and run the whole test suite.
# Any arguments go to pytest, e.g. scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
LLM_SERVING_EXTRAS="[test]" . scripts/_venv.sh
exec python -m pytest "${@:-tests}"
