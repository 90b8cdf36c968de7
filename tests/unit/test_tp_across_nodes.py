"""Tensor parallel across nodes, without MindSpore: the config rules for ranks on other nodes, which parts of
the step buffers rank 0 broadcasts and how they come back, the `llm-serving agent` launcher's ranks and
environment (the token file's rules: test_launch.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from llm_serving.agents import launch
from llm_serving.agents.node import agent_environment, check_ranks
from llm_serving.cli import parse_ranks
from llm_serving.config import ConfigError, load_config
from llm_serving.models.parallel import all_reduce_backend
from llm_serving.shm.buffers import StepBuffers
from llm_serving.shm.layout import StepKind, StepLayout

ACROSS = ("serving_config.agent_ports=[16002,16003,16004]", "serving_config.agent_hosts=[null,null,10.0.0.2]",
          "serving_config.cluster_port=8118", "serving_config.cluster_host=10.0.0.1", "serving_config.agent_token_file=/etc/llm-serving/token",
          "pa_config.num_blocks=64")


def _config(*overrides):
    return load_config(None, tuple(overrides))


def test_a_group_across_nodes_is_described_per_rank():
    sc = _config(*ACROSS).serving_config
    assert sc.remote_ranks == [2]
    assert [sc.node_of(r) for r in range(3)] == ["", "", "10.0.0.2"]
    assert [sc.local_rank(r) for r in range(3)] == [(0, 2), (1, 2), (0, 1)]   # devices start again per node
    # a loopback "other node" is this host: its rank shares this host's cores and devices
    sc = _config(*ACROSS[:1], "serving_config.agent_hosts=[null,null,127.0.0.1]", *ACROSS[2:]).serving_config
    assert sc.remote_ranks == [2] and sc.local_rank(2) == (2, 3)
    assert _config().serving_config.remote_ranks == [] and _config().serving_config.local_rank(0) == (0, 1)


def test_ports_are_distinct_per_node_not_across_nodes():
    sc = _config("serving_config.agent_ports=[16002,16003,16002,16003]",
                 "serving_config.agent_hosts=[null,null,10.0.0.2,10.0.0.2]", *ACROSS[2:]).serving_config
    assert sc.remote_ranks == [2, 3] and sc.local_rank(3) == (1, 2)
    with pytest.raises(ConfigError, match="distinct"):
        _config("serving_config.agent_ports=[16002,16003,16004,16004]",
                "serving_config.agent_hosts=[null,null,10.0.0.2,10.0.0.2]", *ACROSS[2:])
    with pytest.raises(ConfigError, match="distinct"):
        _config("serving_config.agent_ports=[16002,16002]")


@pytest.mark.parametrize("override, key, words", [
    ("serving_config.agent_hosts=[null,10.0.0.2]", "agent_hosts", "one entry per agent_ports entry"),
    ("serving_config.agent_hosts=[10.0.0.2,null,null]", "agent_hosts", "rank 0 runs beside the master"),
    ("serving_config.agent_hosts=[null,null,'']", "agent_hosts", "null (this host) or a host"),
    ("serving_config.agent_ports=[16002,16003,0]", "agent_ports", "needs a fixed port"),
    ("serving_config.cluster_port=0", "cluster_port", "fixed port"),
    ("serving_config.agent_token_file=null", "agent_token_file", "through a file"),
    ("pa_config.num_blocks=auto", "num_blocks", "same KV cache on every rank"),
    ("serving_config.cluster_host=127.0.0.1", "cluster_host", "must reach the cluster's scheduler"),
    ("model_config.all_reduce=shm", "all_reduce", "MindSpore's collectives"),
])
def test_a_group_across_nodes_is_refused_without_what_it_needs(override, key, words):
    with pytest.raises(ConfigError) as err:
        _config(*ACROSS, override)
    assert key in str(err.value) and words in str(err.value)


def test_auto_all_reduce_is_mindspore_across_nodes():
    assert all_reduce_backend("CPU", "auto") == "shm"
    assert all_reduce_backend("CPU", "auto", across_nodes=True) == "mindspore"
    with pytest.raises(ValueError, match="across nodes"):
        all_reduce_backend("CPU", "shm", across_nodes=True)


def test_the_draft_agent_stays_beside_the_master():
    cfg = _config(*ACROSS, "spec_config.method=draft", "spec_config.draft_model=builtin:tiny-llama")
    draft = cfg.draft_config()
    assert draft.serving_config.agent_hosts == [] and draft.serving_config.remote_ranks == []


LAYOUT = StepLayout(max_rows=4, max_tokens=8, max_blocks_per_seq=3, max_context=48, max_verify=5)


def _filled(layout):
    buffers = StepBuffers.private(layout)
    rng = np.random.default_rng(0)
    for name, arr in buffers.arrays.items():
        if arr.dtype == np.float32:
            arr[...] = rng.random(arr.shape, np.float32)
        else:
            arr[...] = rng.integers(-5, 1000, arr.shape)
    return buffers


# the per-row arrays every rank's model work reads (the sampling parameters, adapter slots, multimodal RoPE offsets)
ROW_INPUTS = ("context_lens", "query_lens", "temperature", "top_k", "top_p", "random_u", "top_n", "lora",
              "rope_delta")


@pytest.mark.parametrize("kind, n, s, run", [("decode", 1, 1, 1), ("prefill", 3, 8, 1), ("verify", 4, 5, 1),
                                             ("decode_run", 2, 1, 4), ("decode_run", 4, 1, 5)])
def test_a_steps_inputs_arrive_whole_and_nothing_else_is_touched(kind, n, s, run):
    kind = StepKind(kind)
    verify = kind is StepKind.VERIFY
    src = _filled(LAYOUT)
    words = src.pack_inputs(kind, n, s, run)
    assert words.dtype == np.int32 and words.size == LAYOUT.step_inputs_size(kind, n, s, run)
    # ids, positions and both slot arrays per token; both block tables
    assert words.size == n * (4 * max(s, run) + 2 * LAYOUT.max_blocks_per_seq + len(ROW_INPUTS) + (2 * s if verify else 0))
    assert words.size <= LAYOUT.max_step_inputs_size
    dst = StepBuffers.private(LAYOUT)
    dst.unpack_inputs(words, kind, n, s, run)
    width = max(s, run)
    for name in ("input_ids", "positions", "slot_mapping", "window_slots"):
        np.testing.assert_array_equal(dst.arrays[name][:n, :width], src.arrays[name][:n, :width])
        assert not dst.arrays[name][n:].any() and not dst.arrays[name][:, width:].any()
    np.testing.assert_array_equal(dst.block_tables[:n], src.block_tables[:n])
    np.testing.assert_array_equal(dst.window_tables[:n], src.window_tables[:n])
    for name in ROW_INPUTS:                 # float32 arrays travel bit for bit
        assert dst.arrays[name][:n].tobytes() == src.arrays[name][:n].tobytes()
        assert not dst.arrays[name][n:].any()
    for name in ("verify_random_u", "verify_parent"):
        if verify:
            assert dst.arrays[name][:n, :s].tobytes() == src.arrays[name][:n, :s].tobytes()
        else:
            assert not dst.arrays[name].any()
    # what only rank 0 reads (the sampler's penalties, capture's request ids) and the outputs never travel
    for name in ("history", "history_len", "repetition_penalty", "request_ids", "out_token_ids", "out_verify_ids"):
        assert not dst.arrays[name].any(), name
    dst.close()        # a private buffer has no segment to close or unlink


def test_private_buffers_are_not_shared_memory():
    buffers = StepBuffers.private(LAYOUT)
    assert not buffers.shared and buffers.names == {}
    shared = StepBuffers.create(LAYOUT)
    try:
        assert shared.shared
    finally:
        shared.close()


def test_ranks_parse_and_must_be_on_another_node():
    assert parse_ranks("1") == [1] and parse_ranks("8-11") == [8, 9, 10, 11] and parse_ranks("3,2,3") == [2, 3]
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError, match="--ranks"):
            parse_ranks(bad)
    cfg = _config(*ACROSS, "serving_config.agent_ip=0.0.0.0")
    check_ranks(cfg, [2])
    with pytest.raises(ValueError, match="pass --host"):             # the master could not reach 127.0.0.1
        check_ranks(_config(*ACROSS), [2])
    with pytest.raises(ValueError, match=r"--ranks \[1\].*ranks on other nodes: \[2\]"):
        check_ranks(cfg, [1, 2])
    with pytest.raises(ValueError, match="none"):
        check_ranks(_config(), [0])


def test_a_node_agent_gets_msruns_environment_and_no_shared_memory():
    cfg = _config(*ACROSS, "serving_config.api_key=abcdefgh12")
    env, workdir = agent_environment(cfg, "/models/x", 2, "tok" * 6)
    assert workdir.is_dir()
    assert (env["MS_ROLE"], env["MS_NODE_ID"], env["MS_WORKER_NUM"]) == ("MS_WORKER", "2", "3")
    assert (env["MS_SCHED_HOST"], env["MS_SCHED_PORT"]) == ("10.0.0.1", "8118")
    assert (env["RANK_ID"], env["DEVICE_ID"]) == ("2", "0")        # the first rank on its node: device 0
    spec = json.loads(env[launch.ENV_CONFIG])
    assert spec["rank"] == 2 and spec["remote"] is True and spec["tp_comm"] is None
    assert spec["config"]["serving_config"]["api_key"] is None          # agents never see the HTTP key
    assert env[launch.ENV_TOKEN] == "tok" * 6 and launch.ENV_STATUS_FD not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(__file__).resolve().parents[2])  # this package


def test_after_each_start_the_master_loads_its_lora_registry_into_the_other_nodes_ranks(tmp_path):
    """Agents on other nodes start from their node's YAML; adapters loaded at run time live in the master's
    registry (its snapshot), which it replays into them: each slot's adapter, and the other slots emptied."""
    import asyncio

    from llm_serving.master.agent_group import AgentGroup

    token = tmp_path / "token"
    token.write_text("t" * 20)
    token.chmod(0o600)
    cfg = _config(*ACROSS[:-2], f"serving_config.agent_token_file={token}", "pa_config.num_blocks=64",
                  "lora_config.enable_lora=true", "lora_config.max_loras=3", "model_config.max_generate_length=512")
    snapshot = {3: ("sql", "/adapters/sql"), 1: ("poem", "/adapters/poem")}        # as LoraRegistry.snapshot
    group = AgentGroup(cfg, "/models/x", lora_snapshot=lambda: snapshot)
    assert group.all_reduce == "mindspore" and group.remote_ranks == {2}
    sent = {}

    class Agent:
        def __init__(self, rank):
            self.rank = rank

        async def request(self, command, timeout_s):
            sent.setdefault(self.rank, []).append((command.slot, command.name, command.path))

    group.agents = [Agent(0), Agent(1), Agent(2)]
    asyncio.run(group._sync_remote_lora())
    assert sent == {2: [(1, "poem", "/adapters/poem"), (2, None, None), (3, "sql", "/adapters/sql")]}
