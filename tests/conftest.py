import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"../shared is not present at {SHARED}; it holds the pretrained test model and datasets")
    return SHARED


@pytest.fixture(autouse=True, scope="session")
def _private_runtime_dirs(tmp_path_factory):
    """Agent tokens and the default model cache go to per-run temp dirs unless the caller set them."""
    os.environ.setdefault("LLM_SERVING_RUNTIME_DIR", str(tmp_path_factory.mktemp("run")))
    yield
