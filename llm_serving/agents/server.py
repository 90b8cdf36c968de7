"""The agent process: a TCP server whose commands go through a priority queue to one model worker.

Threads: an acceptor, one reader per connection (frames -> queue), and the main thread, which pops the
queue (control before prefill before decode, FIFO within a class) and runs each command. A watchdog
exits the process when the master that started it is gone (from the start: warmup included; the kernel kills
it first if a graph compile holds the GIL, agents/lifetime.py). The agent reports to its parent through a
pipe, one JSON line per event: `listening` (with the bound port), `ready` (with the facts the master
needs) or `failed` (with the traceback's last line).

Run by the master as `python -m llm_serving.agents.server` with the environment protocol.py names (ENV_*).
"""
from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback

from llm_serving.agents import launch, protocol as proto
from llm_serving.agents.lifetime import expected_parent, parent_gone
from llm_serving.config import config_from_dict

logger = logging.getLogger("llm_serving.agent")

_DETACH = "_detach"     # queued by a reader thread (not a wire command): the master's connection dropped
WARM_IDLE_S = 0.1       # a staged warmup's next entry runs after this long without a command (a running request's
                        # steps come closer together than this; an entry holds the agent 0.1-0.4 s)
WARM_EVERY_S = 1.0      # ... or after this long since the last, however busy
WARM_BUSY_DEFER_S = 15.0    # ... but while every core is busy, none in this long after ready (a load beside
                            # other models' streams: the rest waits until the load's first seconds are over)
EXIT_PEERS_GONE = 3     # exit code: left while stuck in a step whose peers or master are gone (no crash of its own)


class CommandQueue:
    """Commands waiting for the worker: control before prefill before decode, FIFO within a class."""

    def __init__(self):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()

    def put(self, frame: proto.Frame, conn=None, priority: int | None = None) -> None:
        if priority is None:
            priority = proto.priority(frame)
        self._queue.put((priority, next(self._order), frame, conn))

    def get(self, timeout: float | None = None):
        """Block (without spinning) until a command is there; returns (frame, conn)."""
        _, _, frame, conn = self._queue.get(timeout=timeout)
        return frame, conn

    def __len__(self) -> int:
        return self._queue.qsize()


class Connection:
    """One client socket; `authorized` after a '#' carrying the launch token."""

    def __init__(self, sock: socket.socket, peer):
        self.sock = sock
        self.peer = peer
        self.authorized = False
        self.owns_shm = False
        self.is_master = False
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, data: bytes) -> None:
        with self._send_lock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class AgentServer:
    def __init__(self, config, model_dir: str, rank: int, token: str, status_fd: int | None,
                 tp_comm: str | None = None, remote: bool = False):
        self.config = config
        self.rank = rank
        self.tp_comm = tp_comm
        self.remote = remote            # started on another node than the master (`llm-serving agent`)
        self.device_id = config.serving_config.start_device_id + config.serving_config.local_rank(rank)[0]
        self.model_dir = model_dir
        self._token = token
        self._status_fd = status_fd
        self._queue = CommandQueue()
        self._stop = threading.Event()
        self.worker = None
        self.init_watchdog()            # first: the master may die during warmup, which takes minutes
        self.init_socket()
        self.init_worker()

    # --- start-up ----------------------------------------------------------------------------------

    def init_socket(self) -> None:
        sc = self.config.serving_config
        self.listener = socket.create_server((sc.agent_ip, sc.agent_ports[self.rank]), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.report("listening", port=self.port, pid=os.getpid())

    def init_worker(self) -> None:
        from llm_serving.agents.worker import Worker

        # (each phase's wall time, and the CPU time the process spent in it, all its threads: on a machine whose
        # cores serve other models, the CPU is what a load takes from them)
        t0, c0 = time.perf_counter(), time.process_time()
        self.worker = Worker(self.config, self.model_dir, self.rank, self.device_id, self.tp_comm)
        logger.info("agent %d: model loaded in %.1f s, %.1f s of CPU; compiling buckets", self.rank,
                    time.perf_counter() - t0, time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        self.worker.warmup()
        runner = self.worker.runner
        logger.info("agent %d: warmup done in %.1f s, %.1f s of CPU%s", self.rank, time.perf_counter() - t0,
                    time.process_time() - c0, ", for a first request; the rest when idle" if runner.warming else "")
        self._last_warm = time.perf_counter()
        self._warm_busy_until = self._last_warm + WARM_BUSY_DEFER_S

    def init_watchdog(self) -> None:
        self._parent_pid = expected_parent()
        threading.Thread(target=self._watch_parent, name="parent-watchdog", daemon=True).start()

    def report(self, event: str, **fields) -> None:
        report_status(self._status_fd, event, **fields)

    # --- threads -----------------------------------------------------------------------------------

    def _watch_parent(self) -> None:
        while not self._stop.wait(0.5):
            if parent_gone(self._parent_pid):
                logger.warning("agent %d: its parent (pid %d) is gone; exiting", self.rank, self._parent_pid)
                self._exit_soon()
                return

    def _exit_soon(self) -> None:
        """Exit ahead of any queued command; if the main thread is stuck in a step (a peer gone in a collective),
        leave anyway after 2 s."""
        self._queue.put(proto.Frame(proto.EXIT, {"seq": None}), None, priority=-1)
        if not self._stop.wait(2.0):
            os._exit(EXIT_PEERS_GONE)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, peer)
            threading.Thread(target=self._read_loop, args=(conn,), name=f"conn-{peer}", daemon=True).start()

    def _read_loop(self, conn: Connection) -> None:
        while not conn.closed:
            try:
                frame = proto.recv_frame(conn.sock)
            except proto.ProtocolError as exc:
                logger.warning("agent %d: rejected frame from %s: %s", self.rank, conn.peer, exc)
                conn.send(proto.encode(None, proto.Failed(error=f"rejected frame: {exc}")))
                conn.close()  # framing is lost after a bad frame; the client must reconnect
                break
            except (ConnectionError, OSError) as exc:
                if "mid-frame" in str(exc):
                    logger.warning("agent %d: truncated frame from %s dropped (%s)", self.rank, conn.peer, exc)
                conn.close()
                break
            if frame.command == proto.REPLY:
                conn.send(proto.encode(frame.seq, proto.Failed(error="'R' is a reply, not a command")))
                continue
            if not conn.authorized and frame.command != proto.CONNECT:
                logger.warning("agent %d: %r from %s before connect refused", self.rank, frame.command, conn.peer)
                conn.send(proto.encode(frame.seq, proto.Failed(error="not connected: send '#' with the token first")))
                conn.close()
                break
            if frame.command == proto.CONNECT and not self._token_ok(frame.payload.get("token")):
                logger.warning("agent %d: connect with a wrong token from %s refused", self.rank, conn.peer)
                conn.send(proto.encode(frame.seq, proto.Failed(error="connect refused: wrong token")))
                conn.close()
                break
            conn.authorized = True  # the token is what authorizes; '#' itself is queued as control
            if frame.command == proto.CONNECT:   # known here, not when the queued '#' runs: the connection may
                conn.is_master = bool(frame.payload.get("master"))   # drop while warmup still holds the queue
            frame.received = time.perf_counter()
            self._queue.put(frame, conn)
        if conn.owns_shm:
            # the master's connection dropped: its buffers may be unlinked any moment
            self._queue.put(proto.Frame(_DETACH, {"seq": None}), conn, priority=0)
        if conn.is_master and self.remote:
            # an agent on another node: its group's collectives went with the master (or the master restarts the
            # group); exit, so that its node's launcher starts it afresh to join the next cluster
            logger.warning("agent %d: the master's connection dropped; exiting to rejoin", self.rank)
            self._exit_soon()

    def _token_ok(self, token) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token.encode(), self._token.encode())

    # --- command handlers (main thread): (message, frame, connection) -> reply message --------------

    def on_connect(self, msg: proto.Connect, frame, conn) -> proto.ConnectReply:
        if self.remote and msg.master and conn.closed:
            raise ConnectionError("the master's connection dropped before its connect ran")
        if msg.shm is not None:
            self.worker.attach(msg.shm)
            conn.owns_shm = True
        cfg = self.worker.runner.config
        return proto.ConnectReply(rank=self.rank, pid=os.getpid(), device_id=self.device_id,
                                  num_blocks=self.config.pa_config.num_blocks,
                                  block_size=self.config.pa_config.block_size, vocab_size=cfg.vocab_size,
                                  max_position_embeddings=cfg.max_position_embeddings,
                                  cache_epoch=self.worker.cache_epoch,
                                  token_trees=self.worker.runner.buckets.packed,
                                  scores_prompts=self.worker.runner.buckets.packed,
                                  decode_steps=self.worker.runner.decode_run_steps,
                                  decode_run_rows=self.worker.runner.decode_run_max_rows(),
                                  batch_invariant=self.worker.runner.batch_invariant,
                                  image_tokens=self.worker.runner.image_tokens,
                                  max_image_tokens=self.worker.runner.max_image_tokens)

    def on_step(self, msg: proto.Step, frame, conn) -> proto.StepReply:
        images, ahead = msg.step_images(), msg.encode_slice()
        encoded, encode_error, encode_s = self.worker.encode_ahead(ahead) if ahead is not None else (None, None, 0.0)
        model_s = encode_s + self.worker.step(msg.kind, msg.num_rows, msg.max_query_len, msg.steps, images)
        agent_s = time.perf_counter() - frame.received
        return proto.StepReply(step=msg.step, model_ms=round(model_s * 1e3, 4), agent_ms=round(agent_s * 1e3, 4),
                               cache_epoch=self.worker.cache_epoch, collective_calls=self._collective_calls(msg),
                               encoded=encoded, encode_error=encode_error)

    def _collective_calls(self, msg) -> int | None:
        """What a tensor-parallel rank's step reply (ok or failed) tells the master about the group: the
        collective graph calls it has completed (the master compares them across ranks)."""
        if not isinstance(msg, proto.Step) or self.worker.tp.world == 1:
            return None
        return self.worker.runner.collective_calls

    def on_health(self, msg, frame, conn) -> proto.HealthReply:
        bc = self.worker.broadcast
        return proto.HealthReply(pid=os.getpid(), rank=self.rank, device_id=self.device_id,
                                 steps=self.worker.num_steps, attached=self.worker.buffers is not None,
                                 cache_epoch=self.worker.cache_epoch,
                                 input_broadcasts=bc.calls if bc is not None else None,
                                 input_broadcast_ms=round(bc.seconds * 1e3, 3) if bc is not None else None)

    def on_reset(self, msg, frame, conn) -> proto.ResetReply:
        self.worker.reset()
        return proto.ResetReply(cache_epoch=self.worker.cache_epoch)

    def on_capture(self, msg: proto.Capture, frame, conn) -> proto.CaptureReply:
        if msg.max_steps < 1:
            raise ValueError("capture: max_steps must be a positive integer")
        return proto.CaptureReply(**self.worker.set_capture(msg.dir, msg.max_steps))

    def on_load_lora(self, msg: proto.LoadLora, frame, conn) -> proto.LoraReply:
        return proto.LoraReply(**self.worker.load_lora(msg.slot, msg.name, msg.path))

    def on_exit(self, msg, frame, conn) -> proto.Done:
        self._stop.set()
        return proto.Done()

    HANDLERS = {proto.Connect: on_connect, proto.Step: on_step,
                proto.Health: on_health, proto.Reset: on_reset, proto.Exit: on_exit, proto.Capture: on_capture,
                proto.LoadLora: on_load_lora}

    def event_loop(self) -> None:
        threading.Thread(target=self._accept_loop, name="acceptor", daemon=True).start()
        self.report("ready", port=self.port, pid=os.getpid(), num_blocks=self.config.pa_config.num_blocks)
        logger.info("agent %d ready on %s:%d (device %d)", self.rank, self.config.serving_config.agent_ip,
                    self.port, self.device_id)
        from llm_serving.models.parallel import TensorParallelError

        while not self._stop.is_set():
            frame, conn = self._next_command()
            if frame is None:
                continue
            if frame.command == _DETACH:          # the master's connection dropped
                self.worker.detach()
                continue
            msg = None
            try:
                msg = proto.read_command(frame)
                out = self.HANDLERS[type(msg)](self, msg, frame, conn)
            except TensorParallelError as exc:   # the group is out of step: only a restart of all of it helps
                logger.error("agent %d: %r failed: %s", self.rank, frame.command, exc)
                out = proto.Failed(error=f"{type(exc).__name__}: {exc}", fatal=True,
                                   collective_calls=self._collective_calls(msg))
            except Exception as exc:  # a failed command fails only itself; the agent keeps serving
                logger.error("agent %d: %r failed: %s", self.rank, frame.command, exc,
                             exc_info=not isinstance(exc, (ValueError, proto.ProtocolError)))
                out = proto.Failed(error=f"{type(exc).__name__}: {exc}", collective_calls=self._collective_calls(msg))
            if conn is not None:
                conn.send(proto.encode(frame.seq, out))
        self.shutdown()

    def _next_command(self):
        """The next command, (frame, conn); (None, None) after running a warmup entry instead. While a staged
        warmup has entries left (models/warmup.py), one runs whenever no command comes for WARM_IDLE_S, and at
        least every WARM_EVERY_S however busy the agent is, so that the rest of the plan ends (and the compile
        cache's lock is free for the next agent) within seconds of ready -- but none while the machine's cores are
        all busy (other models' agents serving: a load on demand beside them) in the first WARM_BUSY_DEFER_S after
        ready: the rest of a plan is graphs read from the compile cache, which a step that needs one reads itself
        (0.1 s), and the load's first seconds are the other models' too."""
        runner = self.worker.runner
        if not runner.warming:
            return self._queue.get()
        since = time.perf_counter() - self._last_warm
        if time.perf_counter() < self._warm_busy_until and _cores_busy():
            try:
                return self._queue.get(timeout=WARM_IDLE_S)
            except queue.Empty:
                return None, None
        try:
            if since < WARM_EVERY_S:
                return self._queue.get(timeout=WARM_IDLE_S)
        except queue.Empty:
            pass
        try:
            if not runner.warm_next():
                logger.info("agent %d: warmup complete", self.rank)
        except Exception as exc:  # noqa: BLE001 - the graphs then compile when a step needs them
            logger.error("agent %d: warmup after ready failed (the rest compile when a step needs them): %s",
                         self.rank, exc, exc_info=not isinstance(exc, ValueError))
        self._last_warm = time.perf_counter()
        return None, None

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self.listener.close()
        except OSError:
            pass
        if self.worker is not None:
            self.worker.detach()


def report_status(status_fd: int | None, event: str, **fields) -> None:
    """One JSON line to the master's status pipe (`listening`, `ready` or `failed`); nothing without one."""
    if status_fd is None:
        return
    try:
        os.write(status_fd, (json.dumps({"event": event, **fields}) + "\n").encode())
    except OSError:
        pass


_busy = [0.0, False]            # when the machine's CPU share was last measured, and whether its cores were busy


def _cores_busy() -> bool:
    """Whether the machine's cores were all but busy (less than half a core free: psutil's system-wide CPU share)
    over the half second or more before the last measurement, measured again once half a second has passed."""
    import psutil

    now = time.perf_counter()
    if now - _busy[0] >= 0.5:
        cores = psutil.cpu_count() or 1
        _busy[:] = [now, psutil.cpu_percent(interval=None) > 100.0 * (cores - 0.5) / cores]
    return _busy[1]


def _wait_as_spare() -> bool:
    """A spare agent (launch.ENV_SPARE): import what every agent imports (MindSpore, the runner: about 1.2 s), then
    wait for the rest of the environment on standard input; False when it ends first (no model came: exit)."""
    import mindspore  # noqa: F401

    from llm_serving.agents import worker  # noqa: F401
    from llm_serving.models import runner  # noqa: F401

    line = sys.stdin.readline()
    if not line.strip():
        return False
    os.environ.update(json.loads(line)["env"])
    return True


def run_agent_process() -> int:
    """Entry point of an agent process; tells the parent through the status pipe if start-up fails."""
    logging.basicConfig(level=os.environ.get("LLM_SERVING_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status_fd = int(os.environ[launch.ENV_STATUS_FD]) if os.environ.get(launch.ENV_STATUS_FD) else None
    server = None
    try:
        if os.environ.get(launch.ENV_SPARE) == "1" and not _wait_as_spare():
            return 0
        spec = json.loads(os.environ[launch.ENV_CONFIG])
        token = os.environ.pop(launch.ENV_TOKEN)
        config = config_from_dict(spec["config"])
        server = AgentServer(config, spec["model_dir"], int(spec["rank"]), token, status_fd, spec.get("tp_comm"),
                             remote=bool(spec.get("remote")))
        server.event_loop()
        if server.remote:      # MindSpore's teardown may wait for a cluster that is gone: its launcher waits for us
            logging.shutdown()
            os._exit(0)
        return 0
    except BaseException as exc:  # noqa: BLE001 - report anything, including KeyboardInterrupt
        logger.error("agent failed: %s", traceback.format_exc())
        report_status(status_fd, "failed", error=f"{type(exc).__name__}: {exc}")
        if server is not None:
            server.shutdown()
        return 1


if __name__ == "__main__":
    sys.exit(run_agent_process())
