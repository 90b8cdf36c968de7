"""How an agent process is launched (agents/launch.py): its memory's huge pages, the launch token's file."""
import pytest

from llm_serving.agents import launch


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
