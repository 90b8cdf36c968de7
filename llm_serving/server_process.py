"""Run `llm-serving start` as a child process on loopback: free ports, wait for /health, stop with SIGTERM.

Used by the benchmarks under tools/ and by the integration tests; agent ports are picked by the OS.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout: float = 60.0, raw: bytes | None = None,
         headers: dict | None = None):
    """(status, parsed JSON or text) for one request; never raises on HTTP error statuses."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def sse_lines(text: str) -> list:
    """An event stream's lines: SSE ends a line with CR LF, LF or CR only. (str.splitlines also splits at U+2028,
    NEL and other characters that a generated text may hold inside a data line's JSON, unescaped.)"""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def parse_sse(text: str) -> list:
    """The JSON of an event stream's data lines (OpenAI's closing "data: [DONE]" left out)."""
    return [json.loads(line[len("data: "):]) for line in sse_lines(text)
            if line.startswith("data: ") and line != "data: [DONE]"]


class ServerProcess:
    """`llm-serving start --port <free> --set serving_config.agent_ports=[0] *args`, output to `log_path`.

    Later `--set serving_config.agent_ports=...` in `args` wins (e.g. `[0,0]` for two agents)."""

    def __init__(self, args: list, log_path: Path, env: dict | None = None, cwd: str | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "llm_serving.cli", "start", "--port", str(self.port),
               "--set", "serving_config.agent_ports=[0]", *args]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.children: list = []

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log(6000)}")
            try:
                status, _ = http("GET", self.url + "/health", timeout=2)
                if status == 200:
                    self.children = psutil.Process(self.proc.pid).children(recursive=True)
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05 if time.monotonic() < deadline - timeout_s + 60 else 0.5)   # (a start-up's time to 50 ms)
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log(6000)}")

    def log(self, tail_chars: int | None = None) -> str:
        """The server's output so far, whole (the start-up lines tests look for stay in it however many requests'
        access-log lines follow), or its last `tail_chars` (an error message's)."""
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if tail_chars is None else text[-tail_chars:]

    def refresh_children(self) -> list:
        """Re-read the master's child processes (agents restarted since wait_ready are new processes); the
        ones seen before stay listed so that stop() and leak checks still cover them."""
        if self.proc.poll() is None:
            try:
                seen = {p.pid for p in self.children}
                self.children += [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                                  if p.pid not in seen]
            except psutil.NoSuchProcess:
                pass
        return self.children

    def agent_pids(self) -> list:
        """The agent processes among the master's children (the others are Python's resource trackers)."""
        return [p.pid for p in self.children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "llm_serving.agents.server" in " ".join(p.cmdline())]

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30.0) -> int:
        self.refresh_children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # whatever happens above, leave nothing running
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                                   for p in self.children):
            time.sleep(0.1)
        for p in self.children:
            if p.is_running():
                p.kill()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
