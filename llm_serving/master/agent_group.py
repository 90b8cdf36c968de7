"""The master's side of the agents: spawn one process per `agent_ports` entry, wait until each has
compiled its graphs, connect over TCP with the launch token and the shared-memory names, then send
every step to every agent and wait for all replies.

Several agents are one tensor-parallel group (models/parallel.py): each holds a shard, every step goes to
all, rank 0 writes the outputs, and the step succeeds only if every rank's does. Before spawning, the master
sets up what the ranks' all-reduce needs (they all-reduce during warmup): the shared-memory segment
(shm/comm.py) for the CPU's 'shm' all-reduce, or for 'mindspore' (HCCL on Ascend) the scheduler process of a
MindSpore dynamic cluster and each rank's MS_* environment, as msrun would. A restart gets fresh ones.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

from llm_serving.agents import launch, protocol as proto
from llm_serving.agents.lifetime import spawn
from llm_serving.master import spare_agents
from llm_serving.models.parallel import all_reduce_backend, cluster_env
from llm_serving.shm.buffers import StepBuffers
from llm_serving.shm.comm import CommSegment
from llm_serving.shm.layout import StepLayout

logger = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """An agent failed a command, died, or did not answer in time. `fatal` when the agent itself is lost
    (dead, disconnected or hung), not just the one command it answered with a failure."""

    def __init__(self, message: str, fatal: bool = True, reply: Optional[proto.Failed] = None):
        super().__init__(message)
        self.fatal = fatal
        self.reply = reply                # the agent's failure reply, when it answered


class AgentClient:
    """One agent: its process, its status pipe, and a framed TCP connection with replies matched by seq."""

    def __init__(self, rank: int, process: subprocess.Popen, status_reader: asyncio.StreamReader,
                 on_lost=None, role: str = "agent"):
        self.rank = rank
        self.name = f"{role} {rank}"            # in messages: "agent 0", "draft agent 0"
        self.on_lost = on_lost                  # called with the reason when the connection drops unasked
        self.process = process
        self.status_reader = status_reader
        self.port: Optional[int] = None
        self.info: Optional[proto.ConnectReply] = None
        self.cache_epoch = 0                    # the agent's KV-cache resets this client knows of
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        self._pending: dict = {}
        self._seq = itertools.count()
        self._reader_task: Optional[asyncio.Task] = None
        self.dead_reason: Optional[str] = None
        self.closing = False

    async def wait_ready(self, timeout_s: float) -> None:
        """Read the agent's status lines until `ready`; fail on `failed`, process exit or timeout."""
        async def _wait():
            while True:
                line = await self.status_reader.readline()
                if not line:
                    code = await asyncio.get_running_loop().run_in_executor(None, self.process.wait)
                    raise AgentError(f"{self.name} exited with code {code} during start-up")
                event = json.loads(line)
                if event["event"] == "listening":
                    self.port = event["port"]
                elif event["event"] == "ready":
                    self.port = event["port"]
                    return
                elif event["event"] == "failed":
                    raise AgentError(f"{self.name} failed to start: {event.get('error')}")
        try:
            await asyncio.wait_for(_wait(), timeout_s)
        except asyncio.TimeoutError:
            raise AgentError(f"{self.name} not ready after {timeout_s:.0f} s "
                             "(serving_config.agent_start_timeout_s)") from None

    async def connect(self, host: str, token: str, shm_names: Optional[dict], timeout_s: float = 60) -> None:
        self._reader, self._writer = await asyncio.open_connection(host, self.port)
        self._reader_task = asyncio.create_task(self._read_replies())
        self.info = await self.request(proto.Connect(token=token, shm=shm_names, master=True), timeout_s=timeout_s)
        self.cache_epoch = self.info.cache_epoch

    async def connect_remote(self, host: str, token: str, timeout_s: float, not_pid: Optional[int] = None) -> None:
        """Connect to an agent on another node (RemoteProcess), retrying until it accepts and answers, which it
        does once it has joined the group and compiled its graphs. `not_pid`: the process of the group's last
        start, which is on its way out and must not be taken for the new one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        on_lost, self.on_lost = self.on_lost, None       # a try that drops is no lost agent
        try:
            await self._connect_remote(host, token, loop, deadline, not_pid)
        except BaseException:                            # (cancelled too: the start failed elsewhere)
            await self.close()
            raise
        finally:
            self.on_lost = on_lost

    async def _connect_remote(self, host, token, loop, deadline, not_pid) -> None:
        last = "no answer"
        while loop.time() < deadline:
            self.dead_reason, self._pending = None, {}
            try:
                await asyncio.wait_for(self.connect(host, token, None, timeout_s=max(1.0, deadline - loop.time())),
                                       max(1.0, deadline - loop.time()))
            except (OSError, AgentError, asyncio.TimeoutError) as exc:
                last = str(exc) or type(exc).__name__
                if "wrong token" in last:
                    raise AgentError(f"{self.name} on {host}:{self.port} refused the master's token: the same "
                                     "serving_config.agent_token_file on every node") from None
                await self.close()
                self.closing = False
                await asyncio.sleep(0.5)
                continue
            if self.info.pid == not_pid:
                await self.close()
                self.closing = False
                await asyncio.sleep(0.5)
                continue
            self.process.pid = self.info.pid
            return
        raise AgentError(f"{self.name} on {host}:{self.port} not ready in time "
                         f"(serving_config.agent_start_timeout_s; start it there with `llm-serving agent`): {last}")

    async def _read_replies(self) -> None:
        try:
            while True:
                frame = await proto.read_frame_async(self._reader)
                command, fut = self._pending.pop(frame.seq, (None, None))
                if fut is not None and not fut.done():
                    try:
                        fut.set_result(proto.read_reply(frame.payload, command))
                    except proto.ProtocolError as exc:      # an agent of another version: this command fails
                        fut.set_result(proto.Failed(error=f"unreadable reply: {exc}"))
        except (asyncio.IncompleteReadError, ConnectionError, proto.ProtocolError, OSError) as exc:
            self.dead_reason = f"{self.name} connection lost ({type(exc).__name__})"
        finally:
            if self.dead_reason is None:
                self.dead_reason = f"{self.name} connection closed"
            for _, fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(AgentError(self.dead_reason))
            self._pending.clear()
            if not self.closing and self.on_lost is not None:
                code = self.process.poll()
                self.on_lost(self.dead_reason if code is None else f"{self.name} exited with code {code}")

    @property
    def connected(self) -> bool:
        """Connected and not lost: commands can be sent."""
        return self._writer is not None and self.dead_reason is None

    def send(self, command: proto.Message) -> tuple:
        """Write a command frame now (no await: it leaves before any other task runs); returns
        (seq, command, future of the typed reply)."""
        if self._writer is None or self.dead_reason:
            raise AgentError(self.dead_reason or f"{self.name} is not connected")
        seq = next(self._seq)
        fut = asyncio.get_running_loop().create_future()
        self._pending[seq] = (command, fut)
        self._writer.write(proto.encode(seq, command))
        return seq, command, fut

    async def request(self, command: proto.Message, timeout_s: float) -> proto.Reply:
        return await self.wait_reply(*self.send(command), timeout_s)

    async def wait_reply(self, seq: int, command: proto.Message, fut, timeout_s: float) -> proto.Reply:
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            self._pending.pop(seq, None)
            raise AgentError(f"{self.name} did not answer {command.COMMAND!r} within {timeout_s:.0f} s") \
                from None
        if isinstance(reply, proto.Failed):
            raise AgentError(f"{self.name}: {reply.error}", fatal=reply.fatal, reply=reply)
        return reply

    async def close(self) -> None:
        self.closing = True
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if self._reader_task is not None:
            self._reader_task.cancel()


class RemoteProcess:
    """Stands in for the process of an agent on another node, which `llm-serving agent` started there: the
    master neither starts nor kills it. It exits when the master's connection drops, and its node's launcher
    starts it again to join the group's next start."""

    def __init__(self, host: str):
        self.host = host
        self.pid: Optional[int] = None        # from its connect reply
        self.returncode = None

    def poll(self):
        return None                           # not known here: a lost connection says it

    def wait(self, timeout=None):
        return None

    def kill(self) -> None:
        pass                                  # closing the connection is what stops it


async def _fail(exc: BaseException):
    raise exc


def _in_step(tasks: list) -> bool:
    """Whether the ranks are still in step after a step that some failed without being lost. Tensor-parallel
    ranks report how many collective (all-reducing) graph calls they have completed: equal counts mean each
    ran the step's graphs or none did (a rank-0-only failure, such as a sampler or logits capture, or a
    step every rank refused), so only that step's requests fail. Without counts (a single agent), the
    ranks are in step when they all failed."""
    if not all(t.done() and not t.cancelled() for t in tasks):
        return False
    replies = [t.result() if t.exception() is None else getattr(t.exception(), "reply", None) for t in tasks]
    counts = {getattr(r, "collective_calls", None) for r in replies}
    if None in counts:
        return all(t.exception() is not None for t in tasks)
    return len(counts) == 1


class AgentGroup:
    """All agents of one model. Every step goes to every agent; rank 0 writes the outputs."""

    def __init__(self, config, model_dir: str, on_lost=None, role: str = "agent", lora_snapshot=None):
        self.config = config
        self.role = role          # "agent", or "draft agent" (speculative decoding's draft model)
        self.on_lost = on_lost    # called (with a reason) when an agent's connection drops while serving
        # () -> {slot: (name, path)}: the LoRA adapters agents (re)started now load (the master's registry,
        # LoraRegistry.snapshot); None: those of the config
        self.lora_snapshot = lora_snapshot
        self.model_dir = model_dir
        self.layout = StepLayout.from_config(config)
        self.buffers: Optional[StepBuffers] = None
        self.comm: Optional[CommSegment] = None     # tensor parallelism's 'shm' all-reduce segment
        self.scheduler: Optional[subprocess.Popen] = None   # 'mindspore' all-reduce: the cluster's scheduler
        self._cluster_port: Optional[int] = None
        self.agents: list = []
        sc, mc = config.serving_config, config.model_config
        self.remote_ranks = set(sc.remote_ranks)    # agents on other nodes: connected to, not spawned
        self._token = launch.read_token_file(sc.agent_token_file) if sc.agent_token_file else secrets.token_urlsafe(32)
        self._token_files: list = []
        self._remote_pids: dict = {}               # rank -> pid of the remote agent of the last start
        self._closing = False                      # stop() under way: a scheduler's exit is expected
        # the group's all-reduce: 'shm' or 'mindspore' for several agents, None for one
        self.all_reduce = (all_reduce_backend(mc.device_target, mc.all_reduce, bool(self.remote_ranks))
                           if len(sc.agent_ports) > 1 else None)

    async def start(self) -> None:
        sc = self.config.serving_config
        self._closing = False
        self.buffers = StepBuffers.create(self.layout)
        try:
            world = len(sc.agent_ports)
            backend = self.all_reduce
            if backend == "shm":
                self.comm = CommSegment.create(world)
            elif backend == "mindspore":
                self._spawn_scheduler(world)
            for rank in range(len(sc.agent_ports)):
                if rank in self.remote_ranks:
                    agent = AgentClient(rank, RemoteProcess(sc.agent_hosts[rank]), None, on_lost=self.on_lost,
                                        role=self.role)
                    agent.port = sc.agent_ports[rank]
                    self.agents.append(agent)
                else:
                    self.agents.append(await self._spawn(rank))
            # the agents here report ready through their pipes; those on other nodes answer a connect once they
            # have joined the group and compiled (they warm up together, so wait for all at once)
            remote = [a for a in self.agents if a.rank in self.remote_ranks]
            waits = [asyncio.ensure_future(self._wait_ready(sc.agent_start_timeout_s))]
            waits += [asyncio.ensure_future(a.connect_remote(a.process.host, self._token, sc.agent_start_timeout_s,
                                                             self._remote_pids.get(a.rank))) for a in remote]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            finally:                     # the first failure is the start's: no other wait outlives it
                for w in waits:
                    w.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
            failed = [w.exception() for w in waits if w.done() and not w.cancelled() and w.exception() is not None]
            if failed:
                missing = [a for a in remote if a.info is None]
                if missing and not any(isinstance(e, AgentError) and "refused" in str(e) for e in failed):
                    # the ranks here wait for them in MindSpore's cluster: they are the likelier cause
                    where = ", ".join(f"agent {a.rank} ({a.process.host}:{a.port})" for a in missing)
                    raise AgentError(f"{failed[0]}; never answered: {where} on other nodes; start them there with "
                                     f"`llm-serving agent --ranks {','.join(str(a.rank) for a in missing)}`") \
                        from failed[0]
                raise failed[0]
            for agent in self.agents:
                if agent.rank in self.remote_ranks:
                    self._remote_pids[agent.rank] = agent.info.pid
                    logger.info("agent %d (pid %d on %s) connected on port %d", agent.rank, agent.info.pid,
                                agent.process.host, agent.port)
                    continue
                # ranks on other nodes take their inputs from rank 0's broadcast: only rank 0 reads shared memory
                await agent.connect(sc.agent_ip, self._token,
                                    self.buffers.names if agent.rank == 0 or not self.remote_ranks else None)
                self._write_token_file(agent.port)
                logger.info("agent %d (pid %d) connected on port %d", agent.rank, agent.process.pid, agent.port)
            await self._sync_remote_lora()
        except BaseException:
            await self.stop()
            raise

    def _lora_slots(self) -> dict:
        """{slot: (name, path)} of the LoRA adapters agents started now load."""
        if self.lora_snapshot is not None:
            return self.lora_snapshot()
        lc = self.config.lora_config
        return {slot: (name, lc.adapters[name]) for name, slot in lc.slot_of().items()}

    def agent_config(self) -> dict:
        """The configuration an agent started here is given: a copy of the master's, without the HTTP API key
        and with the LoRA adapters in slots now (the YAML's start-up adapters still named, so that the ranks'
        lora_config compares equal across nodes)."""
        config = self.config.to_dict()
        config["serving_config"]["api_key"] = None       # agents never see the HTTP API key
        held = self._lora_slots()
        lora = config["lora_config"]
        lora["adapters"] = {**lora["adapters"], **{name: path for name, path in held.values()}}
        lora["slots"] = {name: slot for slot, (name, _) in held.items()}
        return config

    async def _sync_remote_lora(self) -> None:
        """Agents on other nodes start from their node's YAML, not from the adapters loaded since (the master's
        registry): load each slot's adapter into them, and empty the others."""
        lc = self.config.lora_config
        remote = [a for a in self.agents if a.rank in self.remote_ranks]
        if not remote or not lc.enabled:
            return
        held = self._lora_slots()
        timeout = self.config.serving_config.step_timeout_s
        for slot in range(1, lc.max_loras + 1):
            name, path = held.get(slot, (None, None))
            command = proto.LoadLora(slot=slot, name=name, path=path)
            for agent in remote:
                await agent.request(command, timeout)

    async def _wait_ready(self, timeout_s: float) -> None:
        """Every agent ready; with a cluster scheduler, its exit fails the start at once (its ranks would wait
        for it until the timeout), and afterwards it counts as a lost agent (on_lost)."""
        ready = asyncio.ensure_future(asyncio.gather(*(a.wait_ready(timeout_s) for a in self.agents
                                                      if a.rank not in self.remote_ranks)))
        if self.scheduler is None:
            return await ready
        watch = asyncio.ensure_future(self._scheduler_exit(self.scheduler))
        try:
            await asyncio.wait({ready, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not ready.done():
                ready.cancel()
        if watch.done():             # the scheduler is gone (before, or as, the last agent got ready): the cause
            if ready.done() and not ready.cancelled():
                ready.exception()    # (retrieved: any agent failure follows from the scheduler's exit)
            raise AgentError(f"{watch.result()} while the agents were starting")
        ready.result()                                    # an agent's start-up failure, if any
        scheduler = self.scheduler
        watch.add_done_callback(lambda w: self._on_scheduler_exit(scheduler, w))

    async def _scheduler_exit(self, scheduler: subprocess.Popen) -> str:
        code = await asyncio.get_running_loop().run_in_executor(None, scheduler.wait)
        return f"the tensor-parallel cluster scheduler exited with code {code}"

    def _on_scheduler_exit(self, scheduler: subprocess.Popen, watch: asyncio.Future) -> None:
        """(An exit the group's own stop() caused, or an earlier group's scheduler's, is no failure.)"""
        if scheduler is self.scheduler and not self._closing and not watch.cancelled() and self.on_lost:
            self.on_lost(watch.result())

    def _spawn_scheduler(self, world: int) -> None:
        sc = self.config.serving_config
        self._cluster_port = sc.cluster_port
        if not self._cluster_port:
            with socket.socket() as s:                      # a free port (the scheduler binds it a moment later)
                s.bind((sc.cluster_host, 0))
                self._cluster_port = s.getsockname()[1]
        env, workdir = launch.child_env(cluster_env(world, self._cluster_port, host=sc.cluster_host))
        self.scheduler = spawn([sys.executable, "-m", "llm_serving.models.parallel"], env, workdir)
        logger.info("tensor-parallel cluster scheduler (pid %d) on %s:%d", self.scheduler.pid, sc.cluster_host,
                    self._cluster_port)

    async def _spawn(self, rank: int) -> AgentClient:
        config = self.agent_config()
        given = {launch.ENV_CONFIG: json.dumps({"config": config, "model_dir": self.model_dir, "rank": rank,
                                                "tp_comm": self.comm.name if self.comm is not None else None}),
                 launch.ENV_TOKEN: self._token}
        huge_pages = launch.agent_huge_pages(self.config.serving_config.agent_huge_pages, self.model_dir)
        # a spare agent that has imported MindSpore already (master/spare_agents.py), where one of this kind waits
        # (not for a cluster's ranks: MindSpore's cluster environment is read at exec)
        spare = spare_agents.take(huge_pages) if self.scheduler is None else None
        if spare is not None:
            spare.launch(given)
            logger.info("agent %d: the spare agent (pid %d) started %.1f s ago", rank, spare.process.pid,
                        time.perf_counter() - spare.started)
            process, read_fd = spare.process, spare.status_fd
        else:
            read_fd, write_fd = os.pipe()
            env, workdir = launch.child_env({
                **(cluster_env(len(self.config.serving_config.agent_ports), self._cluster_port, rank,
                               host=self.config.serving_config.cluster_host)
                   if self.scheduler is not None else {}),
                **given, launch.ENV_STATUS_FD: str(write_fd)}, huge_pages=huge_pages)
            process = spawn([sys.executable, "-m", "llm_serving.agents.server"], env, workdir, pass_fds=(write_fd,))
            os.close(write_fd)
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb"))
        return AgentClient(rank, process, reader, on_lost=self.on_lost, role=self.role)

    def _write_token_file(self, port: int) -> None:
        path = launch.token_file(port)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._token)
        self._token_files.append(path)

    async def step(self, command, after_send: Optional[Callable[[], None]] = None) -> tuple:
        """Run one step (a proto.Step) on every agent; returns (their StepReplies in rank
        order, whether some agent's KV cache was reset since the last step: its contents are gone). Raises
        AgentError if any fails, dies or times out (`fatal` when the group cannot go on: see _in_step).
        `after_send`: work done once the frames are out, while the agents compute (the step's logit controls).
        A step that carries images, or encodes one ahead, may take step_timeout_s more per image: the agent may run
        its vision tower on each (tens of seconds an image on a few cores)."""
        images = len(getattr(command, "images", None) or ()) + (getattr(command, "encode", None) is not None)
        timeout = self.config.serving_config.step_timeout_s * (1 + images)
        # Frames go out before this coroutine yields: HTTP handlers woken by the previous step then run
        # while the agents compute, instead of delaying the next step's start.
        sent = []
        for a in self.agents:
            try:
                sent.append(a.send(command))
            except AgentError as exc:
                sent.append(exc)
        tasks = [asyncio.ensure_future(a.wait_reply(*x, timeout) if isinstance(x, tuple) else _fail(x))
                 for a, x in zip(self.agents, sent)]
        try:
            if after_send is not None:
                after_send()
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if pending and any(t.exception() is not None and getattr(t.exception(), "fatal", True) for t in done):
                    # a lost rank: the others may wait for it in the all-reduce until the step timeout; the
                    # group restarts anyway, so do not wait for them
                    break
        finally:                 # (also when this step is cancelled: no rank's wait outlives it)
            for t in tasks:
                t.cancel()
        errors = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if errors:
            fatal = any(getattr(e, "fatal", True) for e in errors) or not _in_step(tasks)
            raise AgentError("; ".join(map(str, errors)), fatal=fatal)
        replies = [t.result() for t in tasks]
        cache_reset = False
        for a, r in zip(self.agents, replies):
            if r.cache_epoch != a.cache_epoch:
                a.cache_epoch, cache_reset = r.cache_epoch, True
        return replies, cache_reset

    async def control(self, command: proto.Message) -> list:
        """A control command (say LoadLora) to every agent; their replies in rank order. AgentError (not fatal
        unless the agent is gone) with the agents' reasons when some fail."""
        timeout = self.config.serving_config.step_timeout_s
        results = await asyncio.gather(*(a.request(command, timeout) for a in self.agents), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise AgentError("; ".join(map(str, errors)), fatal=any(getattr(e, "fatal", True) for e in errors))
        return results

    def describe(self) -> list:
        """rank, pid and port of every agent started."""
        return [{"rank": a.rank, "pid": a.process.pid, "port": a.port,
                 **({"host": a.process.host} if isinstance(a.process, RemoteProcess) else {})} for a in self.agents]

    def dead_agents(self) -> list:
        """Reasons for every agent that is not alive and connected (empty when all are well)."""
        reasons = []
        for a in self.agents:
            code = a.process.poll()
            if code is not None:
                reasons.append(f"{a.name} exited with code {code}")
            elif a.dead_reason:
                reasons.append(a.dead_reason)
        if self.scheduler is not None and self.scheduler.poll() is not None:
            reasons.append(f"the tensor-parallel cluster scheduler exited with code {self.scheduler.returncode}")
        return reasons

    async def stop(self, grace_s: float = 5.0, kill: bool = False) -> None:
        """Ask every agent to exit (or, with kill, SIGKILL them at once: after a failure their state is
        worthless and one may hang), kill those that do not, close connections and unlink shared memory."""
        self._closing = True
        for a in self.agents:
            a.closing = True
            if kill and a.process.poll() is None:
                a.process.kill()
            elif a.process.poll() is None and a.connected:
                try:
                    await a.request(proto.Exit(), timeout_s=grace_s)
                except AgentError:
                    pass
        loop = asyncio.get_running_loop()
        for a in self.agents:
            try:
                await asyncio.wait_for(loop.run_in_executor(None, a.process.wait), grace_s)
            except asyncio.TimeoutError:
                a.process.kill()
                await loop.run_in_executor(None, a.process.wait)
            await a.close()
        self.agents = []
        for path in self._token_files:
            path.unlink(missing_ok=True)
        self._token_files = []
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        if self.scheduler is not None:       # its ranks are gone: nothing left to schedule
            if self.scheduler.poll() is None:
                self.scheduler.kill()
            await loop.run_in_executor(None, self.scheduler.wait)
            self.scheduler = None

