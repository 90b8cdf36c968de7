"""Tensor parallelism without MindSpore: the shared-memory all-reduce kernel called through ctypes exactly as
MindSpore's AOT Custom op calls it, from real processes over a real segment; and how weights are cut."""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from llm_serving.models.kernels import build_kernel
from llm_serving.config import ConfigError, load_config
from llm_serving.models.parallel import (SPLIT_AXIS, TensorParallel, TensorParallelError, all_reduce_backend,
                                         cluster_env, shard_index, split_axis)
from llm_serving.shm.comm import CommSegment, segment_bytes

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                    reason="no C++ compiler on this machine (CPU tensor parallelism needs one)")


def _call(lib, x: np.ndarray) -> tuple:
    """ShmAllReduce(x) as MindSpore invokes it: (return code, output)."""
    out = np.full_like(x, np.nan)
    arrays = [x, out]
    params = (ctypes.c_void_p * 2)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * 2)(*[a.ndim for a in arrays])
    shape_arrays = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * 2)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                    for s in shape_arrays])
    dtypes = (ctypes.c_char_p * 2)(*[str(a.dtype).encode() for a in arrays])
    return lib.ShmAllReduce(ctypes.c_int(2), params, ndims, shapes, dtypes, None, None), out


def _load(path: str):
    lib = ctypes.CDLL(path)
    lib.TpAttach.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_double]
    lib.TpLastError.restype = ctypes.c_char_p
    lib.TpCalls.restype = ctypes.c_uint64
    return lib


def _rank_main(path: str, segment: str, rank: int, world: int, shapes: list, results) -> None:
    """One rank: attach, then all-reduce one array per shape (rank-dependent values)."""
    lib = _load(path)
    rc = lib.TpAttach(("/" + segment).encode(), rank, world, 30.0)
    outs = []
    for i, shape in enumerate(shapes):
        x = np.random.default_rng(100 * i + rank).standard_normal(shape).astype(np.float32)
        code, out = _call(lib, x)
        outs.append((code, out))
    results.put((rank, rc, outs, int(lib.TpCalls())))


@pytest.fixture(scope="module")
def kernel_path():
    return build_kernel("shm_allreduce_cpu", "ShmAllReduce").rsplit(":", 1)[0]       # the agents' (cached) build


@needs_compiler
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_sums_across_processes_identically_on_every_rank(kernel_path, world):
    slot = 256                          # 64 floats per slot: the larger arrays go as several calls
    seg = CommSegment.create(world, slot_bytes=slot)
    shapes = [(1, 8), (7, 33), (64,), (5, 64), (1, 8)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(kernel_path, seg.name, r, world, shapes, results))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        got = sorted((results.get(timeout=60) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        seg.close()
    calls = sum(-(-int(np.prod(s)) // (slot // 4)) for s in shapes)
    for rank, rc, outs, n_calls in got:
        assert rc == 0 and n_calls == calls
        for i, (shape, (code, out)) in enumerate(zip(shapes, outs)):
            expected = sum(np.random.default_rng(100 * i + r).standard_normal(shape).astype(np.float32)
                           for r in range(world))
            assert code == 0
            np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
            assert np.array_equal(out, got[0][2][i][1])          # the same bits on every rank


@needs_compiler
def test_a_missing_peer_times_out_with_a_reason_and_poisons_the_group(kernel_path, tmp_path):
    seg = CommSegment.create(2)
    try:
        # a fresh process per check: the kernel's state is per process, like an agent's
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        p = ctx.Process(target=_lonely_rank, args=(kernel_path, seg.name, results))
        p.start()
        out = results.get(timeout=60)
        p.join(timeout=30)
    finally:
        seg.close()
    assert out["attach"] == 0
    assert out["first"] == 3 and 0.15 <= out["waited_s"] < 10
    assert "rank 0 waited" in out["error"] and "rank 1" in out["error"]
    assert out["second"] == 2 and out["error_after"] == out["error"]     # poisoned: fails at once, same reason
    assert out["again"] != 0 and "already attached" in out["again_error"]    # one group per process


def _lonely_rank(path, segment, results):
    import time
    lib = _load(path)
    attach = lib.TpAttach(("/" + segment).encode(), 0, 2, 0.2)
    t0 = time.monotonic()
    first, _ = _call(lib, np.ones((2, 4), np.float32))
    waited = time.monotonic() - t0
    error = lib.TpLastError().decode()
    second, _ = _call(lib, np.ones((2, 4), np.float32))
    error_after = lib.TpLastError().decode()
    lib2 = _load(path)     # same library, same process: already attached
    again = lib2.TpAttach(("/" + segment).encode(), 0, 2, 0.2)
    results.put({"attach": attach, "first": first, "waited_s": waited, "error": error, "second": second,
                 "error_after": error_after, "again": again, "again_error": lib2.TpLastError().decode()})


@needs_compiler
def test_attach_refuses_a_segment_of_another_world_size(kernel_path):
    seg = CommSegment.create(2)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    try:
        p = ctx.Process(target=_attach_as, args=(kernel_path, seg.name, 1, 3, results))
        p.start()
        rc, error = results.get(timeout=60)
        p.join(timeout=30)
    finally:
        seg.close()
    assert rc != 0 and "not a segment for rank 1 of 3" in error


def _attach_as(path, segment, rank, world, results):
    lib = _load(path)
    rc = lib.TpAttach(("/" + segment).encode(), rank, world, 1.0)
    results.put((rc, lib.TpLastError().decode()))


def test_segment_is_created_private_and_unlinked_on_close():
    seg = CommSegment.create(2, slot_bytes=128)
    path = f"/dev/shm/{seg.name.lstrip('/')}"
    assert os.stat(path).st_mode & 0o077 == 0
    assert os.stat(path).st_size >= segment_bytes(2, 128)
    seg.close()
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        CommSegment.create(1)
    with pytest.raises(ValueError, match="multiple of 64"):
        CommSegment.create(2, slot_bytes=100)


# --- how a layer is cut -----------------------------------------------------------------------------

def test_shard_index_takes_the_ranks_contiguous_part_and_refuses_uneven_splits():
    a = np.arange(24).reshape(4, 6)
    assert np.array_equal(a[shard_index(a.shape, 0, 1, 2)], a[2:])
    assert np.array_equal(a[shard_index(a.shape, 1, 2, 3)], a[:, 4:])
    assert np.array_equal(np.concatenate([a[shard_index(a.shape, 1, r, 3)] for r in range(3)], axis=1), a)
    assert np.array_equal(a[shard_index(a.shape, None, 1, 3)], a)
    with pytest.raises(ValueError, match="cannot split length 4 into 3"):
        shard_index(a.shape, 0, 0, 3)


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_split_of_a_layer_sums_to_the_whole_layer(world):
    """The cut every rank loads (TensorParallel.part, by SPLIT_AXIS), applied to a GQA layer with Qwen2's q/k/v
    biases in numpy: the ranks' partial attention-projection and MLP outputs, summed (the all-reduce), equal the
    unsplit layer."""
    rng = np.random.default_rng(0)
    h, nh, kvh, d, inter, t = 32, 8, 4, 8, 48, 5
    p = "model.layers.0."
    w = {p + "self_attn.q_proj.weight": rng.standard_normal((nh * d, h)),
         p + "self_attn.k_proj.weight": rng.standard_normal((kvh * d, h)),
         p + "self_attn.v_proj.weight": rng.standard_normal((kvh * d, h)),
         p + "self_attn.o_proj.weight": rng.standard_normal((h, nh * d)),
         p + "mlp.gate_proj.weight": rng.standard_normal((inter, h)),
         p + "mlp.up_proj.weight": rng.standard_normal((inter, h)),
         p + "mlp.down_proj.weight": rng.standard_normal((h, inter)),
         p + "self_attn.q_proj.bias": rng.standard_normal(nh * d),
         p + "self_attn.k_proj.bias": rng.standard_normal(kvh * d),
         p + "self_attn.v_proj.bias": rng.standard_normal(kvh * d)}
    assert {k[len(p):] for k in w} == set(SPLIT_AXIS)
    x = rng.standard_normal((t, h))

    def attention_out(w, nh, kvh):
        q = (x @ w[p + "self_attn.q_proj.weight"].T + w[p + "self_attn.q_proj.bias"]).reshape(t, nh, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T + w[p + "self_attn.k_proj.bias"]).reshape(t, kvh, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).reshape(t, kvh, d)
        k, v = np.repeat(k, nh // kvh, axis=1), np.repeat(v, nh // kvh, axis=1)   # GQA: query head j uses j // g
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores += np.triu(np.full((t, t), -1e9), 1)
        prob = np.exp(scores - scores.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", prob, v).reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(w):
        g = x @ w[p + "mlp.gate_proj.weight"].T
        return (g / (1 + np.exp(-g)) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T

    parts = []
    for r in range(world):
        tp = TensorParallel(r, world)
        parts.append({k: v[tp.part(k, v.shape)] for k, v in w.items()})
        assert parts[-1][p + "self_attn.k_proj.weight"].shape == (kvh // world * d, h)
        assert parts[-1][p + "self_attn.o_proj.weight"].shape == (h, nh // world * d)
    attn = sum(attention_out(part, nh // world, kvh // world) for part in parts)
    np.testing.assert_allclose(attn, attention_out(w, nh, kvh), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(sum(mlp(part) for part in parts), mlp(w), rtol=1e-10, atol=1e-10)


def test_only_rank_0_loads_the_logits_tensors_and_replicated_tensors_are_whole():
    rank0, rank1 = TensorParallel(0, 2), TensorParallel(1, 2)
    for name in ("lm_head.weight", "model.norm.weight"):
        assert rank0.needs(name) and not rank1.needs(name) and TensorParallel().needs(name)
    assert rank1.needs("model.embed_tokens.weight") and rank1.needs("model.layers.3.input_layernorm.weight")
    assert split_axis("model.embed_tokens.weight") is None
    assert split_axis("model.layers.3.input_layernorm.weight") is None
    assert split_axis("model.layers.12.mlp.down_proj.weight") == 1
    assert rank1.part("model.embed_tokens.weight", (32, 16)) == (slice(None), slice(None))
    assert rank1.part("model.layers.0.mlp.up_proj.weight", (24, 16)) == (slice(12, 24), slice(None))
    assert TensorParallel().part("model.layers.0.mlp.up_proj.weight", (24, 16)) == (slice(None), slice(None))


def test_group_check_names_what_does_not_divide():
    cfg = SimpleNamespace(num_heads=8, num_kv_heads=4, intermediate_size=172)
    TensorParallel(1, 2).check(cfg)
    TensorParallel(0, 4).check(cfg)
    with pytest.raises(ValueError, match=r"divisible by 3; this model has num_heads=8, num_kv_heads=4, "
                                         r"intermediate_size=172"):
        TensorParallel(0, 3).check(cfg)
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        TensorParallel(0, 8).check(cfg)
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        TensorParallel(2, 2)
    assert TensorParallel(0, 2).writes_outputs and not TensorParallel(1, 2).writes_outputs


def test_all_reduce_backend_is_chosen_by_device_and_checked_in_the_config():
    assert all_reduce_backend("CPU") == "shm" and all_reduce_backend("Ascend") == "mindspore"
    assert all_reduce_backend("CPU", "mindspore") == "mindspore"
    with pytest.raises(ValueError, match="'shm' is not available on Ascend"):
        all_reduce_backend("Ascend", "shm")
    assert load_config(overrides=["model_config.all_reduce=mindspore"]).model_config.all_reduce == "mindspore"
    with pytest.raises(ConfigError, match="model_config.all_reduce.*'auto', 'shm' or 'mindspore'"):
        load_config(overrides=["model_config.all_reduce=nccl"])
    with pytest.raises(ConfigError, match="'shm' is the CPU all-reduce"):
        load_config(overrides=["model_config.device_target=Ascend", "model_config.all_reduce=shm"])


def test_cluster_env_is_what_msrun_gives_the_scheduler_and_each_worker():
    sched = cluster_env(2, 8118)
    assert sched == {"MS_ROLE": "MS_SCHED", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118"}
    worker = cluster_env(16, 8118, rank=9, host="10.0.0.1")
    assert worker["MS_ROLE"] == "MS_WORKER" and worker["MS_NODE_ID"] == "9" and worker["MS_WORKER_NUM"] == "16"
    assert worker["MS_SCHED_HOST"] == "10.0.0.1"


# --- which graph failures are the group's ------------------------------------------------------------------

def test_a_failed_model_graph_under_tensor_parallelism_is_fatal_and_completed_ones_are_counted():
    """RunnerGraphs.call with stand-in graphs (no MindSpore): the model graph all-reduces with the peers, so its
    failure, whatever the cause, is a TensorParallelError (the group restarts); a rank-0-only graph (sampler) fails
    as itself; every completed model graph counts in collective_calls."""
    from llm_serving.models.runner.graphs import RunnerGraphs

    def broken(*args):
        raise RuntimeError("Launch kernel failed: MatMul")

    graphs = RunnerGraphs()
    graphs.all_reduce = SimpleNamespace(error=lambda: None)
    graphs.ms = SimpleNamespace(runtime=SimpleNamespace(synchronize=lambda: None))
    graphs.collective_calls = 0
    graphs.graph_calls = lambda cell, *args: cell(*args)       # (GraphCalls needs Tensors)
    graphs.model = lambda *args: ("token", "logprob", "logits")
    graphs.embedder = lambda *args: "hidden states"         # (an embed step's graph all-reduces too)
    assert graphs.call("model", (8, 1), graphs.model, 1, 2) == ("token", "logprob", "logits")
    assert graphs.call("packed", (64, 4), graphs.model) and graphs.collective_calls == 2
    assert graphs.call("embed", (64,), graphs.embedder) == "hidden states" and graphs.collective_calls == 3
    with pytest.raises(RuntimeError, match="Launch kernel failed") as err:
        graphs.call("sampler", (8,), broken)
    assert not isinstance(err.value, TensorParallelError)
    graphs.model = broken
    with pytest.raises(TensorParallelError, match=r"model graph \(8, 1\): RuntimeError: Launch kernel failed"):
        graphs.call("model", (8, 1), graphs.model)
    graphs.all_reduce = SimpleNamespace(error=lambda: "rank 0 waited 120 s for rank 1")
    with pytest.raises(TensorParallelError, match="waited 120 s for rank 1"):
        graphs.call("model", (8, 1), graphs.model)
    assert graphs.collective_calls == 3


def test_a_sampling_failure_on_rank_0_still_runs_the_remaining_packed_pieces_with_the_peers():
    """A packed prefill of 12 tokens runs as two model calls (8 + 4 tokens); rank 0 samples after each. When
    its sampling fails after the first, the peers are already waiting in the second call's all-reduces:
    rank 0 runs that call too, then fails the step (so the ranks' collective_calls still agree). A single
    agent fails at once."""
    from llm_serving.models.buckets import Buckets
    from llm_serving.models.runner.kernels import KernelChoice
    from llm_serving.models.runner.kv_inputs import KvLayout
    from llm_serving.models.runner.token_steps import TokenSteps
    from llm_serving.models.step_inputs import StepInputs

    def packed_runner(all_reduce):
        buckets = Buckets(decode_batch_sizes=[1], decode_block_widths=[4], prefill_batch_sizes=[2],
                          prefill_seq_lens=[4], prefill_token_sizes=[4, 8], max_blocks_per_seq=4, packed=True)
        kernels = KernelChoice(decode_kernel="attention", layer_kernel=None, serves_all=False, layer_kernel_rows=0,
                               batch_invariant=False, decode_run_steps=1, decode_run_rows=0)   # (tensor parallel)

        def finish(*args):
            raise OSError("sampler failed")
        steps = TokenSteps(buckets, SimpleNamespace(max_blocks_per_seq=4), KvLayout(4, 16), kernels,
                           SimpleNamespace(all_reduce=all_reduce), SimpleNamespace(finish=finish), True)
        steps.calls = []
        steps.run_packed = lambda tb, *args: steps.calls.append(tb)
        return steps

    n, s = 2, 6
    args = (StepInputs(np.ones((n, s), np.int32), np.tile(np.arange(s, dtype=np.int32), (n, 1)),
                       np.arange(n * s, dtype=np.int32).reshape(n, s), np.array([[0], [1]], np.int32),
                       np.full(n, s, np.int32), np.full(n, s, np.int32), {"temperature": np.zeros(n, np.float32)}),
            False)
    rank0 = packed_runner(SimpleNamespace(error=lambda: None))
    with pytest.raises(OSError, match="sampler failed"):
        rank0.packed(*args)
    assert rank0.calls == [8, 4]
    alone = packed_runner(None)
    with pytest.raises(OSError, match="sampler failed"):
        alone.packed(*args)
    assert alone.calls == [8]
