# Sourced by test.sh: the coding-agent CLIs the suite drives against a real server (tests/integration/
# test_coding_agents.py), pinned, from the npm registry into .venv/clis (first run only). Without npm, a message,
# and those tests skip saying why. Never fails the caller.
AGENT_CLIS="@openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197"
if [ ! -x .venv/clis/node_modules/.bin/codex ] || [ ! -x .venv/clis/node_modules/.bin/claude ] \
    || [ "$(cat .venv/clis/.pinned 2>/dev/null)" != "$AGENT_CLIS" ]; then
  if command -v npm >/dev/null 2>&1; then
    mkdir -p .venv/clis
    # shellcheck disable=SC2086
    if (cd .venv/clis && npm install --silent --no-audit --no-fund $AGENT_CLIS >/dev/null 2>&1); then
      echo "$AGENT_CLIS" > .venv/clis/.pinned
    else
      echo "could not install $AGENT_CLIS from npm: the coding-agent tests will be skipped" >&2
    fi
  else
    echo "npm is not installed: the coding-agent tests (Codex CLI, Claude Code) will be skipped" >&2
  fi
fi
