import pytest

from tests.integration.server_harness import ServerProcess, leftovers, project_shm_segments, REPO


@pytest.fixture(scope="session")
def stories_server(shared_dir, tmp_path_factory):
    """The pretrained stories260K model served from its HF directory, with its config (one per run)."""
    pytest.importorskip("mindspore")
    shm_before = set(project_shm_segments())
    server = ServerProcess(["--config", str(REPO / "configs" / "stories260K.yaml"),
                            "--model", str(shared_dir / "models" / "stories260K" / "hf")],
                           tmp_path_factory.mktemp("stories") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert leftovers(server) == []
    assert set(project_shm_segments()) - shm_before == set()
