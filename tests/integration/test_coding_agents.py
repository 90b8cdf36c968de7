"""The coding agents people point at a local server, as their npm releases are (scripts/_agent_clis.sh installs them,
pinned, into .venv/clis): OpenAI's Codex CLI (`codex exec`, the Responses API with its namespace and web_search
tools, client_metadata, developer messages mid-conversation) and Anthropic's Claude Code (`claude -p`, the Messages
API with context_management, adaptive thinking, system messages mid-conversation, 24 tools). Each must finish a
one-line task with exit status 0:

- on a tiny model with a context long enough for their whole prompts (Claude Code's is ~30,000 tokens of the tiny
  model's 1,024-piece vocabulary), rigged so that it ends its reply at once (the CLIs' runs are then a few requests,
  whatever a random model would write: only the protocol is under test);
- Claude Code on the default model (SmolLM2, 8,192 tokens: its prompt without the tools fits). Codex's prompt (9,149
  tokens with its tools, 5,800 without its multi-agent and goal tools) fits too, but SmolLM2 sampled at Codex's
  temperature 1 rarely ends its reply under Codex's instructions, and Codex calls a reply cut at its length an
  error: that run is a model's behaviour, not the server's, and stays out of the suite.

A field a new release refuses shows up here, and in tests/unit/test_unknown_fields.py's replay of their captured
requests, before a user meets it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.server_harness import REPO, serving

CLIS = Path(os.environ.get("LLM_SERVING_AGENT_CLIS", REPO / ".venv" / "clis")) / "node_modules" / ".bin"
TASK = "say hello"
RUN_TIMEOUT_S = 300


def cli(name: str) -> str:
    path = CLIS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {CLIS} (scripts/test.sh installs the coding-agent CLIs with npm: "
                    "scripts/_agent_clis.sh)")
    return str(path)


def ending_model(out: Path) -> Path:
    """A tiny random LLaMA (1,024-piece vocabulary, 65,536 positions) whose every reply is EOS at once: the
    residual stream's dimension 0 is a constant no layer writes to, the final norm keeps only it, and only EOS's
    lm_head row reads it."""
    from safetensors.numpy import load_file, save_file
    subprocess.run([sys.executable, "-m", "llm_serving.cli", "make-model", "--out", str(out), "--layers", "2",
                    "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
                    "--max-positions", "65536", "--seed", "5"], check=True, capture_output=True)
    tensors = load_file(out / "model.safetensors")
    tensors["model.embed_tokens.weight"][:, 0] = 4.0
    for name, t in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            t[0, :] = 0.0
    tensors["model.norm.weight"][:] = 0.0
    tensors["model.norm.weight"][0] = 1.0
    tensors["lm_head.weight"][:] = 0.0
    tensors["lm_head.weight"][2, 0] = 64.0           # eos_token_id 2 (make-model's config)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory):
    pytest.importorskip("mindspore")
    model = ending_model(tmp_path_factory.mktemp("ending") / "model")
    with serving(["--model", str(model), "--set", "serving_config.max_num_batched_tokens=2048"],
                 tmp_path_factory.mktemp("agents") / "server.log") as server:
        yield server


def run(args: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "CODEX_",
                                                                        "CLAUDE_"))}, **env}
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def codex(url: str, model: str, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "local"\n[model_providers.local]\nname = "llm-serving"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')
    work = tmp_path / "work"
    work.mkdir()
    return run([cli("codex"), "exec", "--skip-git-repo-check", *flags, TASK],
               {"CODEX_HOME": str(home), "OPENAI_API_KEY": "unused"}, work)


def claude(url: str, model: str, tmp_path: Path, *flags: str, **env) -> subprocess.CompletedProcess:
    home = tmp_path / "claude-home"
    home.mkdir()
    return run([cli("claude"), "-p", TASK, "--model", model, *flags],
               {"HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", **env}, tmp_path)


def test_codex_exec_finishes_a_task_on_a_long_context_model(long_context_server, tmp_path):
    done = codex(long_context_server.url, "model", tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    log = long_context_server.log()
    assert "left out tools of type 'web_search'" in log          # Codex's hosted tool, named once
    assert "ignored unknown field" not in log or "client_metadata" not in log


def test_claude_code_finishes_a_task_on_a_long_context_model(long_context_server, tmp_path):
    done = claude(long_context_server.url, "model", tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_claude_code_finishes_a_task_on_the_default_model(smollm2_server, tmp_path):
    """SmolLM2's 8,192 tokens take Claude Code's prompt without its 24 tools (--tools ""); its 32,000-token
    max_tokens is a ceiling (cut to the context). Claude Code calls a reply cut at max_tokens an error: 512 leaves
    SmolLM2's greeting room to end."""
    from llm_serving.models.default_model import SMOLLM2_NAME
    done = claude(smollm2_server.url, SMOLLM2_NAME, tmp_path, "--tools", "",
                  CLAUDE_CODE_MAX_OUTPUT_TOKENS="512")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip()                                   # SmolLM2's reply, printed
