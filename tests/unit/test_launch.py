"""How an agent process is launched (agents/launch.py): whether its memory is in huge pages and how it asks for
them, the launch token's file."""
import pytest

from llm_serving.agents import launch


def test_agent_huge_pages_auto_goes_by_the_checkpoint_size(tmp_path):
    """auto: huge pages for checkpoints under HUGE_PAGES_MAX_BYTES (a GGUF file, or a directory's weight files;
    a built-in model's name is not a path: small); on and off as given."""
    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    small.write_bytes(b"\0" * 1024)
    with open(big, "wb") as f:                       # sparse: its size, not its blocks
        f.truncate(launch.HUGE_PAGES_MAX_BYTES + 1)
    shards = tmp_path / "hf"
    shards.mkdir()
    for i in range(2):
        with open(shards / f"model-{i}.safetensors", "wb") as f:
            f.truncate(launch.HUGE_PAGES_MAX_BYTES // 2 + 1)
    (shards / "tokenizer.json").write_bytes(b"{}")
    assert launch.agent_huge_pages("auto", str(small)) is True
    assert launch.agent_huge_pages("auto", str(big)) is False
    assert launch.agent_huge_pages("auto", str(shards)) is False     # the shards together
    assert launch.agent_huge_pages("auto", "builtin:tiny-llama") is True
    assert launch.agent_huge_pages("on", str(big)) is True and launch.agent_huge_pages("off", str(small)) is False


def test_huge_pages_join_the_glibc_tunables_an_agent_starts_with():
    assert launch.with_huge_pages({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert launch.with_huge_pages(env)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}                   # not changed in place
    mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}                            # the user's own choice stays
    assert launch.with_huge_pages(mine) == mine


def test_the_token_file_must_be_private_and_hold_a_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret-token-of-enough-length\n")
    path.chmod(0o600)
    assert launch.read_token_file(str(path)) == "s3cret-token-of-enough-length"
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        launch.read_token_file(str(path))
    path.write_text("short")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16"):
        launch.read_token_file(str(path))
    with pytest.raises(ValueError, match="No such file"):
        launch.read_token_file(str(tmp_path / "missing"))
