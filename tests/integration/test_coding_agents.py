"""The coding agents people point at a local server, as their npm releases are (scripts/_agent_clis.sh installs them,
pinned, into .venv/clis): OpenAI's Codex CLI (`codex exec`, the Responses API with its namespace and web_search
tools, client_metadata, developer messages mid-conversation) and Anthropic's Claude Code (`claude -p`, the Messages
API with context_management, adaptive thinking, system messages mid-conversation, 24 tools). Each must finish a
one-line task with exit status 0 on a tiny model with a context long enough for their whole prompts (Claude Code's
is ~30,000 tokens of the tiny model's 1,024-piece vocabulary), rigged so that it ends its reply at once (the CLIs'
runs are then a few requests, whatever a random model would write: only the protocol is under test); and each's
request as captured, with 20 unknown fields added, is answered.

On the default model (SmolLM2, 8,192 tokens) both run, but not in the suite: Claude Code's prompt fits without its
tools (`--tools ""`), Codex's without its multi-agent and goal tools (5,800 tokens; 9,149 with them), and SmolLM2,
sampled at their temperature 1 (neither sends another), often does not end its reply before their length limit,
which both CLIs call an error (Claude Code: "response exceeded the N output token maximum"; Codex: "Incomplete
response returned"): whether a run exits 0 there is the model's behaviour, not the server's. Greedy does not save it
(measured with both APIs' default temperature set to 0: Claude Code's 1,484-token prompt got 6,708 tokens to the
length limit, Codex's 5,755-token prompt 2,437 tokens repeating its instructions).

A field a new release refuses shows up here, and in tests/unit/test_unknown_fields.py's replay of their captured
requests, before a user meets it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.server_harness import REPO, http, serving

CLIS = Path(os.environ.get("LLM_SERVING_AGENT_CLIS", REPO / ".venv" / "clis")) / "node_modules" / ".bin"
TASK = "say hello"
# a captured Claude Code request (its long system prompt and tools) took 106 s alone on a 2-core Zen 3 (AVX2) and over
# 300 s beside the suite's other worker there: the bound is for a hang, not a speed check
RUN_TIMEOUT_S = 600


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


@pytest.mark.parametrize("captured", ["codex_0.171.0_responses.json", "claude_code_2.1.197_messages.json"])
def test_a_captured_agent_request_with_20_unknown_fields_is_answered(long_context_server, captured):
    """Each CLI's request as its release sent it (tests/assets/clients/), 20 fields no API knows added at every depth,
    sent as it is (streamed): answered, the stream complete."""
    import json
    from tests.unit.test_unknown_fields import CLIENTS, with_unknown_fields
    sent = json.loads((CLIENTS / captured).read_text())
    body = with_unknown_fields({**sent["body"], "model": "model"})
    status, text = http("POST", long_context_server.url + sent["path"], body, timeout=RUN_TIMEOUT_S)
    assert status == 200, text
    last = "response.completed" if "responses" in captured else "message_stop"
    assert f"event: {last}" in text, text[-500:]
