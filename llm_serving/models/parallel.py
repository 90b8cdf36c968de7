"""Tensor parallelism: how a rank's shard of the model is cut, and the one all-reduce it needs.

`serving_config.agent_ports: [p0, p1, ...]` starts that many agents, rank r pinned to device
start_device_id + r; together they hold one model (Megatron-style, two all-reduces per layer):

- attention: rank r keeps query heads [r*NH/W, (r+1)*NH/W) and KV heads [r*KVH/W, (r+1)*KVH/W) (the q/k/v
  rows of its heads, and its KV cache holds only its KV heads), and the o_proj columns of its query heads;
  its o_proj output is a partial sum, all-reduced before the residual add;
- MLP: rank r keeps intermediate units [r*I/W, (r+1)*I/W) (gate/up rows, down_proj columns); the
  down_proj output is all-reduced likewise;
- replicated: the embedding, the layer norms and RoPE on every rank; the final norm and lm_head on rank 0
  only, since only rank 0 computes logits and samples (the final hidden state is the same on every rank
  after the last all-reduce; the others stop there, and their graph returns it so that no all-reduce is
  pruned). A vocab-parallel embedding would save (1 - 1/W) V*H per rank: at LLaMA-2-7B (float32) 0.26 GB
  at W=2, next to 26 GB of layers, so the simpler replication was kept.

Each rank reads only its part of the checkpoint (`weights.load_llama_weights(path, tp)`, by SPLIT_AXIS and
`TensorParallel.part`): its float32 arrays are 1/W of the layers plus the replicated tensors, never the
whole model and then a cut.

NH, KVH and I must divide by W (checked at load, with the numbers in the message).

The all-reduce, chosen here and nowhere else (`all_reduce_backend`, `make_all_reduce`), both inside the
graph, so a step is still one graph call per bucket:

- 'mindspore' (the default on Ascend): `ops.AllReduce` over MindSpore's communication, HCCL on Ascend. The
  ranks form a MindSpore dynamic cluster, the environment msrun would set (`cluster_env`): the master
  starts the cluster's scheduler process (`python -m llm_serving.models.parallel`) and gives rank r
  MS_ROLE=MS_WORKER, MS_NODE_ID=r. On the CPU the same path runs over MindSpore's CPU collectives, which is
  how it is tested here (about 1 ms per call on this machine, so it is not the CPU default).
- 'shm' (the default on the CPU): an `ops.Custom` kernel summing through a shared-memory segment that the
  master creates (kernels/shm_allreduce_cpu.cc, shm/comm.py); microseconds per call, a bounded wait for
  peers, and no dependency on MindSpore's CPU collectives.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["TensorParallel", "TensorParallelError", "SPLIT_AXIS", "split_axis", "shard_index", "make_all_reduce",
           "StepInputBroadcast", "all_reduce_kernel", "all_reduce_backend", "cluster_env", "pin_cpu_cores"]


class TensorParallelError(RuntimeError):
    """The group is out of step (its all-reduce failed: a peer is dead, hung or out of step; or this rank's
    model graph failed, leaving its peers in an all-reduce it never reaches): the group must restart."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its group: rank of world, the all-reduce backend ('shm' or 'mindspore'), for
    'shm' the segment's name, and whether the group spans nodes."""

    rank: int = 0
    world: int = 1
    comm: Optional[str] = None
    backend: str = "shm"
    across_nodes: bool = False      # rank 0 broadcasts the step inputs (StepInputBroadcast), which only it reads

    def __post_init__(self) -> None:
        if not (isinstance(self.world, int) and self.world >= 1 and isinstance(self.rank, int)
                and 0 <= self.rank < self.world):
            raise ValueError(f"tensor parallel: rank {self.rank!r} of world {self.world!r} is not valid")

    @property
    def writes_outputs(self) -> bool:
        return self.rank == 0

    def needs(self, name: str) -> bool:
        """Whether this rank uses checkpoint tensor `name` at all (the logits' tensors only on rank 0)."""
        return self.writes_outputs or name not in OUTPUT_ONLY

    def part(self, name: str, shape: tuple) -> tuple:
        """The index of the part of tensor `name` (of full `shape`) that this rank holds."""
        return shard_index(shape, split_axis(name) if self.world > 1 else None, self.rank, self.world)

    def check(self, cfg) -> None:
        """Raise ValueError unless the model's heads and MLP width split evenly over the ranks."""
        w = self.world
        bad = [f"{name}={val}" for name, val in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                                                 ("intermediate_size", cfg.intermediate_size)) if val % w]
        if bad:
            raise ValueError(f"tensor parallel over {w} agents (serving_config.agent_ports) needs num_heads, "
                             f"num_kv_heads and intermediate_size divisible by {w}; this model has "
                             f"{', '.join(bad)}")


# The Megatron split, by a layer tensor's HF name: the axis of which a rank holds 1/world (q/k/v and gate/up by
# output rows, o_proj and down_proj by input columns). Every other tensor is replicated.
SPLIT_AXIS = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
              "self_attn.q_proj.bias": 0, "self_attn.k_proj.bias": 0, "self_attn.v_proj.bias": 0,
              "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
              "mlp.down_proj.weight": 1}
# (every other layer tensor, the norms' gains among them, q/k heads' included, is whole on every rank)
OUTPUT_ONLY = ("lm_head.weight", "model.norm.weight")     # used only for logits, which rank 0 alone computes


def split_axis(name: str) -> Optional[int]:
    """The axis tensor `name` (HF naming) is split on across ranks, or None when every rank holds all of it."""
    if not name.startswith("model.layers."):
        return None
    return SPLIT_AXIS.get(name.split(".", 3)[3])


def shard_index(shape: tuple, axis: Optional[int], rank: int, world: int) -> tuple:
    """The index (a tuple of slices) of rank's contiguous 1/world of a tensor of `shape` along `axis`
    (everything when axis is None)."""
    index = [slice(None)] * len(shape)
    if axis is not None:
        size = shape[axis]
        if size % world:
            raise ValueError(f"cannot split length {size} into {world} equal shards")
        step = size // world
        index[axis] = slice(rank * step, (rank + 1) * step)
    return tuple(index)


def pin_cpu_cores(rank: int, world: int) -> Optional[int]:
    """CPU 'device' pinning: give each of `world` agents its own share of this process's cores (rank r gets
    the r-th share) so the ranks of a group never contend for a core while one waits in the all-reduce.
    Returns the cores kept, or None (cores left alone) when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if world < 2 or len(cores) < world:
        return None
    per = len(cores) // world
    mine = cores[rank * per:(rank + 1) * per]
    os.sched_setaffinity(0, mine)
    logger.info("tensor-parallel rank %d of %d pinned to CPU cores %s", rank, world, mine)
    return len(mine)


def all_reduce_backend(device_target: str, setting: str = "auto", across_nodes: bool = False) -> str:
    """model_config.all_reduce resolved for a device: 'auto' is HCCL through MindSpore on Ascend, shared
    memory on the CPU unless the group spans nodes (a shared-memory segment is one host's)."""
    if setting == "auto":
        return "mindspore" if device_target == "Ascend" or across_nodes else "shm"
    if setting not in ("shm", "mindspore") or (setting == "shm" and (device_target != "CPU" or across_nodes)):
        raise ValueError(f"all-reduce {setting!r} is not available on {device_target}"
                         + (" across nodes" if across_nodes else ""))
    return setting


def cluster_env(world: int, port: int, rank: Optional[int] = None, host: str = "127.0.0.1") -> dict:
    """Environment of one process of a MindSpore dynamic cluster (what msrun sets for each process it
    starts): the scheduler when rank is None, else worker `rank` (its rank id, as MS_NODE_ID is numeric)."""
    env = {"MS_WORKER_NUM": str(world), "MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port),
           "MS_ROLE": "MS_SCHED" if rank is None else "MS_WORKER"}
    if rank is not None:
        env["MS_NODE_ID"] = str(rank)
    return env


class _ShmAllReduceLibrary:
    """The CPU kernel's library, loaded through ctypes from the same file MindSpore loads (so both see one
    set of globals), attached to the group's segment once per process."""

    def __init__(self, func: str, tp: TensorParallel, timeout_s: float):
        path = func.rsplit(":", 1)[0]
        self.lib = ctypes.CDLL(path)
        self.lib.TpAttach.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_double]
        self.lib.TpSetTimeout.argtypes = [ctypes.c_double]
        self.lib.TpLastError.restype = ctypes.c_char_p
        self.lib.TpCalls.restype = ctypes.c_uint64
        name = tp.comm if tp.comm.startswith("/") else "/" + tp.comm      # shm_open wants the leading slash
        if self.lib.TpAttach(name.encode(), tp.rank, tp.world, float(timeout_s)) != 0:
            raise TensorParallelError(self.last_error())

    def last_error(self) -> str:
        return self.lib.TpLastError().decode(errors="replace")


class AllReduce:
    """Sum a float32 tensor over the group, inside a MindSpore graph. `op` is the graph operator; the
    rest is for the runner: `set_timeout` (how long a rank waits for its peers) and `error` (why the
    last failure happened, when the all-reduce was the cause)."""

    def __init__(self, tp: TensorParallel, device_target: str, timeout_s: float, kernel: Optional[str] = None):
        from mindspore import ops

        self.tp = tp
        self._lib = None
        if tp.backend == "mindspore":
            from mindspore.communication import get_group_size, get_rank, init
            init("hccl" if device_target == "Ascend" else None)    # the environment (cluster_env) names the peers
            if (get_rank(), get_group_size()) != (tp.rank, tp.world):
                raise TensorParallelError(f"MindSpore's cluster made this agent rank {get_rank()} of "
                                          f"{get_group_size()}, expected {tp.rank} of {tp.world}")
            self.op = ops.AllReduce()                     # sum over the world group
        else:
            if tp.comm is None:
                raise ValueError("tensor parallel on the CPU needs the group's shared-memory segment name")
            func = kernel or all_reduce_kernel(tp, device_target)
            self._lib = _ShmAllReduceLibrary(func, tp, timeout_s)
            self.op = ops.Custom(func, out_shape=lambda x: x, out_dtype=lambda x: x, func_type="aot")

    def set_timeout(self, seconds: float) -> None:
        if self._lib is not None:
            self._lib.lib.TpSetTimeout(float(seconds))

    def error(self) -> Optional[str]:
        if self._lib is None:
            return None
        return self._lib.last_error() or None

    def calls(self) -> int:
        return int(self._lib.lib.TpCalls()) if self._lib is not None else 0


class StepInputBroadcast:
    """Rank 0's step inputs to every rank, over the group's MindSpore collectives (HCCL on Ascend), for groups
    that span nodes: only rank 0 runs beside the master and reads its shared memory.

    A step's inputs are one int32 array (StepBuffers.pack_inputs: token ids, positions, slots, block tables,
    per-row lengths and sampling parameters; a few KB for a decode step). Every rank knows the array's length
    from the step frame (rows, tokens per row, kind), so one broadcast moves it: rank 0 sends, the others
    receive. It is padded to a power of two (at least MIN_WORDS), so the graphs are a handful, compiled by
    `warmup`. It runs on the host before the model graph, not inside it, because each rank chooses that graph
    (its bucket, the decode block width, the LoRA rows) from these values.

    `check_same(sections)` all-gathers digests of each rank's configuration before the first model collective:
    ranks started from different configs would otherwise compile different graphs and hang in their first
    all-reduce."""

    MIN_WORDS = 1024

    def __init__(self, tp: TensorParallel, max_words: int):
        import mindspore as ms
        from mindspore import nn, ops

        if tp.backend != "mindspore":
            raise ValueError("the step-input broadcast runs over MindSpore's collectives (all_reduce 'mindspore')")
        self.tp = tp
        self._ms = ms
        self.max_words = max_words

        class _Broadcast(nn.Cell):
            def __init__(self):
                super().__init__()
                self.op = ops.Broadcast(0)

            def construct(self, x):
                return self.op((x,))[0]

        class _AllGather(nn.Cell):
            def __init__(self):
                super().__init__()
                self.op = ops.AllGather()

            def construct(self, x):
                return self.op(x)

        self._broadcast, self._gather = _Broadcast(), _AllGather()
        self._staging = {}                   # words -> this rank's padded int32 buffer
        self.calls = 0
        self.seconds = 0.0                   # spent broadcasting (the step's cost of spanning nodes)

    def bucket(self, words: int) -> int:
        if words > self.max_words:
            raise ValueError(f"step inputs of {words} words exceed the most a step takes ({self.max_words})")
        return max(self.MIN_WORDS, 1 << max(0, words - 1).bit_length())

    def buckets(self) -> list:
        sizes, size = [], self.MIN_WORDS
        while True:
            sizes.append(size)
            if size >= self.max_words:
                return sizes
            size *= 2

    def __call__(self, words: Optional[np.ndarray], size: int) -> np.ndarray:
        """Rank 0: broadcast `words` (int32, `size` of them); other ranks: pass None and get rank 0's `size`
        words. TensorParallelError when the collective fails (a peer is gone): the group must restart."""
        padded = self.bucket(size)
        buf = self._staging.get(padded)
        if buf is None:
            buf = self._staging[padded] = np.zeros(padded, np.int32)
        if words is not None:
            buf[:size] = words
        t0 = time.perf_counter()
        try:
            out = self._broadcast(self._ms.Tensor(buf)).asnumpy()
        except Exception as exc:                 # noqa: BLE001 - any failure here is the group's
            raise TensorParallelError(f"step-input broadcast of {size} words: {type(exc).__name__}: {exc}") \
                from exc
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out[:size]

    def warmup(self) -> dict:
        """Compile (and time, as each rank sees it) the broadcast of every bucket; {words: seconds}."""
        times = {}
        for padded in self.buckets():
            size = min(padded, self.max_words)
            words = None if self.tp.rank else np.zeros(size, np.int32)
            self(words, size)
            t0 = time.perf_counter()
            self(words, size)
            times[padded] = time.perf_counter() - t0
        self.calls, self.seconds = 0, 0.0
        return times

    def check_same(self, sections: dict) -> None:
        """Raise TensorParallelError on every rank, naming the sections, unless every rank's `sections` (name ->
        JSON-able value) are rank 0's: a digest of each is all-gathered."""
        import hashlib
        import json

        names = sorted(sections)
        mine = np.concatenate([np.frombuffer(hashlib.sha256(json.dumps(sections[k], sort_keys=True, default=str)
                                                             .encode()).digest()[:16], np.int32) for k in names])
        try:
            every = self._gather(self._ms.Tensor(mine.copy())).asnumpy().reshape(self.tp.world, len(names), 4)
        except Exception as exc:                 # noqa: BLE001
            raise TensorParallelError(f"comparing the ranks' configurations: {type(exc).__name__}: {exc}") from exc
        differ = {r: [k for i, k in enumerate(names) if not np.array_equal(every[r, i], every[0, i])]
                  for r in range(1, self.tp.world)}
        differ = {r: keys for r, keys in differ.items() if keys}
        if differ:
            raise TensorParallelError("the ranks of this group started differently: " + "; ".join(
                f"rank {r}'s {', '.join(keys)} differ{'s' if len(keys) == 1 else ''} from rank 0's"
                for r, keys in differ.items()) + " (use the same YAML, --set options and model on every node)")


def all_reduce_kernel(tp: TensorParallel, device_target: str) -> Optional[str]:
    """The "path.so:func" of the CPU all-reduce kernel when this group uses it (built on first use), else None.
    Part of the compile-cache key: a cached graph names the library it calls."""
    if tp.world == 1 or tp.backend != "shm":
        return None
    from .kernels import build_kernel
    return build_kernel("shm_allreduce_cpu", "ShmAllReduce")


def make_all_reduce(tp: TensorParallel, device_target: str, timeout_s: float = 120.0,
                    kernel: Optional[str] = None) -> Optional[AllReduce]:
    """The group's all-reduce (tp.backend) on this device, or None for a single agent (nothing to reduce);
    `kernel`: all_reduce_kernel's result, when already built."""
    if tp.world == 1:
        return None
    return AllReduce(tp, device_target, timeout_s, kernel)


def _run_cluster_scheduler() -> None:
    """The scheduler of a MindSpore dynamic cluster (started by the master with cluster_env(world, port)):
    serves the ranks' registration until they leave, and exits when the master that started it is gone."""
    import threading
    import time

    import psutil

    parent = os.getppid()

    def watch():
        while psutil.pid_exists(parent) and os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()
    import mindspore as ms
    from mindspore.communication import init
    ms.set_context(mode=ms.GRAPH_MODE)
    init()


if __name__ == "__main__":
    _run_cluster_scheduler()
