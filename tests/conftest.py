import os
import re
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
# stories260K (MIT, llama2.c's tinyllamas): the pretrained model, its tokenizer and llama2.c's greedy text, kept
# with the tests (see its README.md)
STORIES = REPO / "tests" / "assets" / "stories260K"
TOK512 = STORIES / "tok512.model"                    # its tokenizer (hf/tokenizer.model is the same file)
# Licence-restricted files, never in the repository: a developer may keep them beside it (../shared); the tests use
# generated stand-ins (tests/standins.py), and the few that check the real file skip without it (restricted_file)
RESTRICTED = REPO.parent / "shared"
LLAMA2_TOKENIZER = "tokenizers/llama2/tokenizer.model"   # the LLaMA-2 tokenizer, Llama 2 Community License
ALPACA_SAMPLE = "datasets/alpaca_5000.json"              # 5,000 Stanford Alpaca records, CC BY-NC 4.0
# why each cannot travel with the repository nor be installed by scripts/test.sh
RESTRICTED_WHY = {
    LLAMA2_TOKENIZER: "Meta's LLaMA-2 tokenizer, under the Llama 2 Community License, which this repository does not "
                      "redistribute, and no package the tests install holds it",
    ALPACA_SAMPLE: "a sample of Stanford Alpaca, under CC BY-NC 4.0 (non-commercial), which this repository does not "
                   "redistribute, and no package the tests install holds it",
}

# Two paths over a float16 KV cache (the default) whose float32 K/V differ in their last bits (their products sum
# in other orders: kernel and MindSpore, one row and many, AVX2 and AVX-512) store the same float16 values except
# where one lands across a rounding midpoint: that value moves by a step (2^-11 of it), and the difference is
# carried into every later position's K/V. Their log-probabilities along a 60-120 token reply (stories260K) then
# differ by up to 2.4e-3 (measured on an AVX2 Zen 3; the AVX-512 machines before it stayed within 2e-3); rounding
# every value to float16 moves the logits by up to 1e-2 of their size (test_correctness), and a wrong position,
# slot or token changes the tokens themselves, which the tests compare exactly.
FLOAT16_CACHE_LOGPROB_ATOL = 5e-3

# This test process's mark, inherited by every server and agent it starts: its shared-memory segments are
# named with it and its processes carry it, so the leak checks below see only this process's (with
# pytest-xdist, each worker is such a process and the workers' checks do not see each other's servers).
SESSION_TAG = f"t{os.getpid()}"
os.environ["LLM_SERVING_SHM_TAG"] = SESSION_TAG
os.environ["LLM_SERVING_TEST_SESSION"] = SESSION_TAG


def _sweep_earlier_sessions() -> None:
    """The segments of earlier test processes killed together with their servers (a suite stopped by a kill of its
    process group): no later start sweeps them, since each test process has a tag of its own, so a test process
    sweeps those of every tag t<pid> whose test process is gone (and, as every sweep, only of masters gone too)."""
    from llm_serving.shm.sweep import SHM_DIR, sweep_stale_segments

    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return
    tags = {m.group(1) for m in (re.match(r"llmsrv_(t[0-9]+)_p", n) for n in names) if m}
    for tag in tags - {SESSION_TAG}:
        if not psutil.pid_exists(int(tag[1:])):
            sweep_stale_segments(tag=tag)


_sweep_earlier_sessions()


def restricted_file(name: str) -> Path:
    """The licence-restricted file `name` (LLAMA2_TOKENIZER, ALPACA_SAMPLE) where a developer keeps it, or a skip
    naming it."""
    path = RESTRICTED / name
    if not path.is_file():
        pytest.skip(f"needs {path}: {RESTRICTED_WHY[name]} (CI lays shared/ beside its clone; this test checks the "
                    "real file, the others use a generated stand-in)")
    return path


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """tests/assets/stories260K: hf/ (config.json, model.safetensors, tokenizer.model), stories260K.bin (the same
    weights, llama2.c's format) and greedy_reference.json."""
    return STORIES


@pytest.fixture(scope="session")
def alpaca_standin(tmp_path_factory) -> Path:
    """An alpaca-shaped dataset generated for the run (tests.standins): the tests never need the alpaca sample."""
    from tests.standins import write_alpaca_standin

    return write_alpaca_standin(tmp_path_factory.mktemp("datasets") / "alpaca_standin.json")


@pytest.fixture(scope="session")
def llama_tokenizer_standin(tmp_path_factory) -> Path:
    """A LLaMA-style sentencepiece model (BPE, byte fallback, <unk> <s> </s> = 0 1 2) generated for the run, where
    a test needs such a tokenizer and not the LLaMA-2 one itself."""
    from tests.standins import write_llama_tokenizer_standin

    return write_llama_tokenizer_standin(tmp_path_factory.mktemp("tokenizers") / "tokenizer.model")


def _project_processes(since: float) -> list:
    import psutil

    from llm_serving.shm.sweep import runs_llm_serving

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        args = p.info["cmdline"] or []
        cmd = " ".join(args)
        # the project's processes by what they run, not by a path that happens to contain the name (a checkout in a
        # folder called llm-serving runs every helper from there)
        ours = runs_llm_serving(args)
        if p.info["create_time"] >= since and p.pid != os.getpid() and ours:
            try:
                mine = p.environ().get("LLM_SERVING_TEST_SESSION") == SESSION_TAG
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if mine:
                found.append(f"{p.pid}: {cmd[:120]}")
    return found


def _project_shm() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"llmsrv_{SESSION_TAG}_")}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True, scope="session")
def _nothing_left_after_the_suite():
    """After the whole run: no process the suite started is alive, no shm segment it made is left."""
    start, shm_before = time.time() - 1, _project_shm()
    yield
    deadline = time.monotonic() + 10   # processes being reaped by their parents
    while time.monotonic() < deadline and _project_processes(start):
        time.sleep(0.2)
    assert _project_processes(start) == [], "processes of the project outlived the test suite"
    assert _project_shm() - shm_before == set(), "shared-memory segments of the project outlived the suite"


@pytest.fixture(autouse=True, scope="session")
def _private_runtime_dirs(tmp_path_factory):
    """Agent tokens and the default model cache go to per-run temp dirs unless the caller set them."""
    os.environ.setdefault("LLM_SERVING_RUNTIME_DIR", str(tmp_path_factory.mktemp("run")))
    yield
