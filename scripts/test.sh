#!/usr/bin/env bash
# Install what the tests drive from the OS (nginx, Chromium: scripts/_os_packages.sh, when this user may) and
# llm-serving with its test extras into ./.venv (first run only), then run the whole test suite, the test files
# spread over LLM_SERVING_TEST_WORKERS (default 2) processes (pytest-xdist; 0 = one process). The tests need
# nothing outside the repository. Any arguments go to pytest, e.g. scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_os_packages.sh
LLM_SERVING_EXTRAS="[test]" . scripts/_venv.sh
. scripts/_agent_clis.sh
exec python -m pytest -n "${LLM_SERVING_TEST_WORKERS:-2}" --dist loadfile "${@:-tests}"
