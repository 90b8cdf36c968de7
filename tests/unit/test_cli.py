"""The command line's contract (DESIGN.md): every subcommand answers --help; make-model writes a model."""
import json
import subprocess
import sys

import pytest
from safetensors.numpy import load_file

from llm_serving.cli import main


@pytest.mark.parametrize("command", ["start", "agent-ctl", "bench", "precision", "make-model"])
def test_every_subcommand_answers_help(command):
    out = subprocess.run([sys.executable, "-m", "llm_serving.cli", command, "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: llm-serving {command}")


def test_make_model_writes_a_random_llama_of_the_asked_shape(tmp_path, capsys):
    assert main(["make-model", "--out", str(tmp_path / "m"), "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--intermediate", "96", "--seed", "3"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (2, 64, 2)
    assert config["vocab_size"] == 1024                 # the built-in story tokenizer's pieces
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)     # 2 kv heads of 16
    assert (tmp_path / "m" / "tokenizer.model").is_file() and "wrote" in capsys.readouterr().out
    main(["make-model", "--out", str(tmp_path / "again"), "--layers", "2", "--hidden", "64", "--heads", "4",
          "--kv-heads", "2", "--intermediate", "96", "--seed", "3"])
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert all((again[k] == v).all() for k, v in weights.items())               # --seed decides the weights


def test_make_model_refuses_heads_that_do_not_split_and_a_missing_tokenizer(tmp_path, capsys):
    assert main(["make-model", "--out", str(tmp_path / "m"), "--hidden", "64", "--heads", "5"]) == 2
    assert "--heads 5" in capsys.readouterr().err
    assert main(["make-model", "--out", str(tmp_path / "m"), "--tokenizer", str(tmp_path / "none.model")]) == 2
    assert "cannot read the tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
