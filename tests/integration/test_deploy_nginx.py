"""deploy/nginx/llm-serving.conf with real nginx (the OS package, run as bench/replicas.py runs it) in front of three real stories260K replicas:
with one replica draining on SIGTERM and, after, one whose agent is gone for good (max_agent_restarts=0: it
answers 503 with its reason), every new request through nginx succeeds, streaming or not, and no request in
flight on the draining replica is cut. Skipped where nginx is not installed (.ci/run installs it)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.replicas import Nginx, nginx_config
from tests.integration.server_harness import REPO, ServerProcess, free_port, http, leftovers, parse_sse

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: apt-get install nginx; "
                                                      ".ci/run does)")


def _stories(stories_dir, *sets):
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"),
            "--model", str(stories_dir / "hf")]
    for s in sets:
        args += ["--set", s]
    return args


def _request(url, i):
    """(ok, what) of one request through the balancer: streaming on odd i, 24 tokens with ignore_eos."""
    body = {"inputs": f"Once upon a time {i}", "parameters": {"max_new_tokens": 24, "ignore_eos": True}}
    if i % 2:
        status, text = http("POST", url + "/generate_stream", body, timeout=60)
        events = parse_sse(text) if status == 200 else []
        return status == 200 and len(events) == 24 and events[-1]["details"]["finish_reason"] == "length", status
    status, out = http("POST", url + "/generate", body, timeout=60)
    return status == 200 and out["details"]["generated_tokens"] == 24, (status, out)


def test_requests_through_nginx_survive_a_draining_and_a_failed_replica(stories_dir, tmp_path):
    replicas = [ServerProcess(_stories(stories_dir, "serving_config.max_agent_restarts=0"), tmp_path / "a.log"),
                ServerProcess(_stories(stories_dir), tmp_path / "b.log"),
                ServerProcess(_stories(stories_dir, "serving_config.shutdown_grace_s=30"), tmp_path / "c.log")]
    nginx = None
    try:
        for r in replicas:
            r.wait_ready()
        a, b, c = replicas
        listen = free_port()
        nginx = Nginx(NGINX, nginx_config([r.port for r in replicas], listen, tmp_path / "nginx"), listen).__enter__()
        url = f"http://127.0.0.1:{listen}"
        with ThreadPoolExecutor(8) as pool:
            assert all(ok for ok, _ in pool.map(lambda i: _request(url, i), range(12)))

            # 1. replica c drains (SIGTERM) while streams run on it: they finish, new requests go elsewhere
            in_flight = [pool.submit(http, "POST", f"{c.url}/generate_stream",
                                     {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 200,
                                                                                   "ignore_eos": True}}, timeout=60)
                         for _ in range(3)]
            time.sleep(0.3)
            c.proc.send_signal(signal.SIGTERM)
            results = list(pool.map(lambda i: _request(url, i), range(40)))
            assert all(ok for ok, _ in results), [w for ok, w in results if not ok][:3]
            for f in in_flight:
                status, text = f.result()
                events = parse_sse(text)
                assert status == 200 and len(events) == 200 and events[-1]["details"]["finish_reason"] == "length"
            assert c.proc.wait(60) == 0

            # 2. replica a's agent dies for good (no restarts): it answers 503, nginx goes to b
            os.kill(a.agent_pids()[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while http("GET", a.url + "/health")[0] != 503:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            results = list(pool.map(lambda i: _request(url, i), range(40)))
            assert all(ok for ok, _ in results), [w for ok, w in results if not ok][:3]
        # the request id travels through the balancer both ways
        req = urllib.request.Request(url + "/generate", data=json.dumps({"inputs": "Hi", "parameters": {
            "max_new_tokens": 2}}).encode(), headers={"Content-Type": "application/json",
                                                      "X-Request-Id": "through-nginx-1"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "through-nginx-1"
    finally:
        if nginx is not None:
            nginx.__exit__(None, None, None)
        for r in replicas:
            r.stop()
    for r in replicas:
        assert leftovers(r) == []
