import pytest

from tests.integration.server_harness import REPO, serving


@pytest.fixture(scope="session")
def stories_server(stories_dir, tmp_path_factory):
    """The pretrained stories260K model served from its HF directory, with its config (one per run)."""
    pytest.importorskip("mindspore")
    with serving(["--config", str(REPO / "configs" / "stories260K.yaml"),
                  "--model", str(stories_dir / "hf")],
                 tmp_path_factory.mktemp("stories") / "server.log") as server:
        yield server
