#!/usr/bin/env python
"""Replicas behind nginx (issue 26): output tokens/s of one replica reached directly, one behind nginx
(deploy/nginx/llm-serving.conf) and N replicas behind it, same workload, one run; each replica gets the
machine's cores / N model threads (replicas that share cores slow each other's kernel threads down).

    python bench/replicas.py                            # stories260K, 2 replicas, 16 streams
    python bench/replicas.py --model DIR --replicas 2 --streams 16,64

Needs nginx (Debian: apt-get install nginx). Writes JSON (default bench_results/replicas.json).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, SHARED, info, log_dir, machine, synthetic_samples, table, write_json  # noqa: E402
from bench.peers import measure as measure_levels  # noqa: E402
from llm_serving.server_process import ServerProcess, free_port  # noqa: E402


def nginx_config(ports: list, listen: int, workdir: Path) -> Path:
    """deploy/nginx/llm-serving.conf with these replicas and listening port, inside a minimal nginx.conf whose
    pid, logs and temp files are under workdir (no system directory needed)."""
    site = (REPO / "deploy" / "nginx" / "llm-serving.conf").read_text()
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;\n" for p in ports)
    site = re.sub(r"(upstream llm_serving \{\n)(?:    server [^\n]*\n)+", lambda m: m.group(1) + servers, site)
    site = site.replace("listen 8000;", f"listen 127.0.0.1:{listen};")
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    temps = "".join(f"    {kind}_temp_path {workdir}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                              "scgi"))
    conf.write_text(f"worker_processes 1;\npid {workdir}/nginx.pid;\nerror_log {workdir}/error.log warn;\n"
                    f"events {{ worker_connections 1024; }}\nhttp {{\n    access_log off;\n{temps}{site}\n}}\n")
    return conf


class Nginx:
    """nginx in the foreground on `conf`, ready when its port accepts connections; stopped on exit."""

    def __init__(self, binary: str, conf: Path, port: int):
        self.binary, self.conf, self.port, self.proc = binary, conf, port, None

    def __enter__(self) -> "Nginx":
        self.proc = subprocess.Popen([self.binary, "-c", str(self.conf), "-g", "daemon off;"], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start: {self.proc.stderr.read().decode(errors='replace')}")
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(SHARED / "models" / "stories260K" / "hf"))
    p.add_argument("--config", default=str(REPO / "configs" / "stories260K.yaml"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--streams", default="16")
    p.add_argument("--rounds", type=int, default=4, help="requests per level = rounds * streams")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, help="model threads per replica (default: this machine's cores / replicas, so "
                                               "that the replicas do not take each other's cores)")
    p.add_argument("--out", default="bench_results/replicas.json")
    args = p.parse_args(argv)
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        print("SKIPPED: nginx is not installed (Debian: apt-get install nginx)")
        write_json(args.out, {"scenario": "replicas", "skipped": "no nginx"})
        return 0
    streams = [int(s) for s in args.streams.split(",")]
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // args.replicas)
    cli = ["--model", args.model] + (["--config", args.config] if args.config else []) + \
        ["--set", f"model_config.num_threads={threads}"]
    servers = [ServerProcess(cli, log_dir() / f"replica_{i}.log") for i in range(args.replicas)]
    runs = {}
    try:
        for s in servers:
            s.wait_ready()
        facts = info(servers[0])
        model = facts["model_id"]

        samples = {s: synthetic_samples(args.rounds * s, facts["tokenizer_path"], args.input_len, args.output_len)
                   for s in streams}

        def measure(url):
            return measure_levels(url, model, samples, backend="llm-serving")

        runs["1 replica, direct"] = measure(servers[0].url)
        work = Path(tempfile.mkdtemp(prefix="nginx-bench-"))
        for label, chosen in (("1 replica, nginx", servers[:1]), (f"{args.replicas} replicas, nginx", servers)):
            port = free_port()
            with Nginx(binary, nginx_config([s.port for s in chosen], port, work / label.replace(" ", "_")), port):
                runs[label] = measure(f"http://127.0.0.1:{port}")
    finally:
        for s in servers:
            s.stop()
    base = "1 replica, direct"
    rows = []
    for s in streams:
        row = {"streams": s}
        for label, r in runs.items():
            row[label] = r[s]["output_throughput"]
            row[f"{label} failed"] = r[s]["failed"]
            row[f"{label} / direct"] = r[s]["output_throughput"] / runs[base][s]["output_throughput"]
        rows.append(row)
    cols = [("streams", "streams", "{}")] + [(label, f"{label} tok/s", "{:.1f}") for label in runs]
    cols += [(f"{label} / direct", f"{label} / direct", "{:.2f}") for label in runs if label != base]
    print(f"\nreplicas behind nginx: {Path(args.model).name}, {args.input_len} -> {args.output_len} tokens, "
          f"{threads} model thread(s) per replica")
    print(table(rows, cols))
    write_json(args.out, {"scenario": "replicas", "machine": machine(), "model": args.model, "threads": threads,
                          "rows": rows,
                          "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()}})
    return 0 if all(r[f"{label} failed"] == 0 for r in rows for label in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
