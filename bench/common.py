"""What the benchmark scenarios share: start a server, replay samples through the load client, time bare
model steps, print a table, write JSON. Every scenario measures what it compares in one run."""
from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import psutil

from llm_serving.agents.launch import with_huge_pages
from llm_serving.loadgen.client import benchmark
from llm_serving.loadgen.metrics import summarize
from llm_serving.loadgen.workload import TokenCounter, load_alpaca, synthetic
from llm_serving.server_process import ServerProcess, free_port, http
from llm_serving.shm.layout import StepView

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
ALPACA = SHARED / "datasets" / "alpaca_5000.json"


def memory_like_agents() -> None:
    """Run this script again, at once, with the memory setting that agents get (huge pages,
    serving_config.agent_huge_pages) when this process lacks it, so that bare steps timed here stream their
    weights from the same kind of pages as a served model's."""
    env = with_huge_pages(dict(os.environ))
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class PeerServer:
    """Another project's server (vLLM, llama.cpp's llama-server) as a child process on loopback, in its own session:
    started with `cmd` (whose port is `port`), ready when GET `ready_path` answers 200, stopped with SIGTERM (then
    SIGKILL) with everything it started."""

    def __init__(self, name: str, cmd: list, port: int, log_path: Path, env: Optional[dict] = None,
                 ready_path: str = "/health"):
        self.name, self.port, self.ready_path = name, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "wb")
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float = 1200) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if http("GET", self.url + self.ready_path, timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05 if time.monotonic() < deadline - timeout_s + 60 else 0.5)   # (a start-up's time to 50 ms)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "PeerServer":
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def set_file_cache(path: str, state: str) -> None:
    """Put the file at `path` in the page cache ('cached': read through once) or out of it ('dropped': its clean
    pages let go, as after a reboot or when memory pressure took them), or leave it ('as-is'), so that two servers'
    starts read the same model file from the same place. A directory: every file under it."""
    if state == "as-is" or not os.path.exists(path):
        return
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, names in os.walk(path)
                                                 for f in sorted(names)]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            if state == "dropped":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 16 << 20):
                    pass
        finally:
            os.close(fd)


def start_settled(log_text: str) -> bool:
    """Whether a start of this server has done what it goes on doing after /health answers: a staged warmup's rest
    (models/warmup.py, run when idle), the repack of the matrices left for after the load (threads:
    kernels/repack.py's LaterRepacks) and the write of its repacked panels for the next start (kernels/panel_store.py).
    A measurement waits for it, so that none lands in its figures and a warm start after a first one finds what the
    first one left."""
    import re

    warming = "for a first request" in log_text and "warmup complete" not in log_text
    kept = re.search(r"([0-9.]+) GB repacked into files kept for the next", log_text)
    # (repacked after the load: its line comes once the panels kept, those of the load's too, are written)
    repacking = "GB to repack after the load" in log_text and "repacked after the load:" not in log_text
    writing = (kept is not None and float(kept.group(1)) > 0 and "GB to repack after the load" not in log_text
               and "kept on disk for the next start" not in log_text)
    return not warming and not repacking and not writing


def with_llama_server(cmd: list, log_path: Path, work, extra: Optional[list] = None) -> tuple:
    """(work(peer), the extra flags it needed) for a llama-server started with `cmd` (its binary and flags, without
    --port) on a free port. A build made with GGML_NATIVE on a CPU with AMX runs AMX tile instructions for
    quantized weights (its weight repacking), which a host may not allow (SIGILL or SIGSEGV at the first matrix
    product, as on this project's CI machines): a server that dies of a signal at start is started again with
    `--no-repack`, and the caller passes the flags on to its next servers."""
    extra = list(extra or [])
    for attempt in range(2):
        port = free_port()
        peer = PeerServer("llama-server", [*cmd, "--port", str(port), *extra], port, log_path)
        try:
            with peer:
                return work(peer), extra
        except RuntimeError as e:
            peer.stop()
            if extra or attempt or peer.proc.returncode is None or peer.proc.returncode >= 0:
                raise
            print(f"llama-server died at start ({e}); running it with --no-repack", flush=True)
            extra = ["--no-repack"]
    raise AssertionError("unreachable")


def process_tree(pid: int) -> list:
    """The process `pid` and all its descendants (those still running), as psutil.Process."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def sum_memory(procs: list) -> dict:
    """{"pss": bytes, "rss": bytes, "processes": n} summed over `procs` (psutil.Process or anything with
    memory_full_info()); a process gone meanwhile, or unreadable, is left out. PSS splits each shared page among
    the processes mapping it, so the sum counts shared memory (weights, shared-memory segments) once; RSS counts
    it in every process."""
    pss = rss = n = 0
    for p in procs:
        try:
            m = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        pss, rss, n = pss + m.pss, rss + m.rss, n + 1
    return {"pss": pss, "rss": rss, "processes": n}


def tree_memory(pid: int) -> dict:
    """PSS and RSS (bytes) of a server: its process and all its descendants (this project's master and its
    agents; llama-server alone; vLLM and its engine processes)."""
    return sum_memory(process_tree(pid))


def machine() -> dict:
    return {"cpu": _cpu_model(), "logical_cores": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2 ** 30, 1), "python": platform.python_version(),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M")}


def server_args(model: Optional[str], config: Optional[str], sets: list) -> list:
    args = []
    if config:
        args += ["--config", config]
    if model:
        args += ["--model", model]
    for item in sets:
        args += ["--set", item]
    return args


def info(server: ServerProcess) -> dict:
    return http("GET", server.url + "/info")[1]


def alpaca(n: int, tokenizer: str, cap: int, path: Path = ALPACA, room: Optional[int] = None) -> list:
    """The first n alpaca prompts that fit `room` tokens (prompt + BOS + output)."""
    if not Path(path).is_file():
        sys.exit(f"alpaca dataset not found at {path} (pass --dataset-path)")
    counter = TokenCounter(tokenizer)
    samples = []
    for s in load_alpaca(str(path), 2 * n + 100, counter, cap):
        if room:
            s.max_new_tokens = min(s.max_new_tokens, room - 1 - s.prompt_len)
        if s.max_new_tokens >= 1:
            samples.append(s)
        if len(samples) == n:
            break
    return samples


def synthetic_samples(n: int, tokenizer: str, input_len: int, output_len: int, seed: int = 0) -> list:
    return synthetic(n, input_len, output_len, 0.0, TokenCounter(tokenizer), seed=seed)


def replay(url: str, model: str, samples: list, offsets: list, *, backend: str = "llm-serving",
           max_concurrency: Optional[int] = None) -> tuple:
    """(summary, results) of one load-client run; the summary uses vLLM's definitions."""
    results, duration = asyncio.run(benchmark(url, backend, model, samples, offsets,
                                              max_concurrency=max_concurrency, ignore_eos=True, progress=False))
    return summarize(results, duration, [50, 90, 99]), results


def _median_execute(runner, step, iters: int) -> float:
    """Median seconds of runner.execute(step) (a StepView) over `iters` calls, after one that compiles / warms."""
    runner.execute(step)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _greedy(n: int) -> dict:
    """Greedy sampling arrays for n rows."""
    return dict(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
                random_u=np.zeros(n, np.float32))


def time_decode_steps(runner, batch: int, context: int, iters: int) -> float:
    """Median seconds of one bare decode step of `batch` rows, each `context` tokens long."""
    bs = runner.block_size
    blocks = -(-(context + 1) // bs)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    pos = np.full((batch, 1), context, np.int32)
    slots = tables[:, context // bs:context // bs + 1] * bs + context % bs
    ids = np.full((batch, 1), 5, np.int32)
    step = StepView("decode", input_ids=ids, positions=pos, slot_mapping=slots.astype(np.int32), block_tables=tables,
                    context_lens=np.full(batch, context + 1, np.int32), query_lens=np.ones(batch, np.int32),
                    **_greedy(batch))
    return _median_execute(runner, step, iters)


def time_decode_run(runner, batch: int, context: int, iters: int) -> float:
    """Median seconds per step of a bare decode run (runner.decode_run_steps steps) of `batch` rows, each
    `context` tokens long when it starts."""
    k, bs = runner.decode_run_steps, runner.block_size
    blocks = -(-(context + k) // bs)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    pos = np.arange(context, context + k)
    slots = (tables[:, pos // bs] * bs + pos % bs).astype(np.int32)                   # (batch, k)
    step = StepView("decode_run", input_ids=np.full((batch, 1), 5, np.int32),
                    positions=np.full((batch, 1), context, np.int32), slot_mapping=slots, block_tables=tables,
                    context_lens=np.full(batch, context + 1, np.int32))
    return _median_execute(runner, step, iters) / k


def time_prefill_step(runner, rows: int, tokens: int, iters: int) -> float:
    """Median seconds of one bare prefill step of `rows` fresh prompts of `tokens` tokens each."""
    bs = runner.block_size
    blocks = -(-tokens // bs)
    tables = np.arange(rows * blocks, dtype=np.int32).reshape(rows, blocks)
    pos = np.tile(np.arange(tokens, dtype=np.int32), (rows, 1))
    slots = (tables[:, pos[0] // bs] * bs + pos % bs).astype(np.int32)
    step = StepView("prefill", input_ids=np.full((rows, tokens), 5, np.int32), positions=pos, slot_mapping=slots,
                    block_tables=tables, context_lens=np.full(rows, tokens, np.int32),
                    query_lens=np.full(rows, tokens, np.int32), **_greedy(rows))
    return _median_execute(runner, step, iters)


def table(rows: list, cols: list) -> str:
    """Plain-text table; cols = [(key, header, format)]."""
    head = "  ".join(f"{h:>{max(len(h), 10)}}" for _, h, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for key, h, fmt in cols:
            v = r.get(key)
            cells.append(f"{(fmt.format(v) if v is not None else 'n/a'):>{max(len(h), 10)}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def write_json(path: str, result: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1))
    print(f"wrote {p}")


def log_dir() -> Path:
    d = Path(os.environ.get("LLM_SERVING_BENCH_LOGS", "bench_results/logs"))
    d.mkdir(parents=True, exist_ok=True)
    return d
