#!/usr/bin/env python
"""Memory stream: how fast this machine's cores read memory, the ceiling of a one-stream decode step, which reads
every weight once per token. A plain read loop (C, compiled here with the kernels' compiler: 256-bit loads, 4 in
flight, a prefetch 4 KiB ahead, over a buffer in huge pages far larger than the caches) on 1 and on --threads
threads, --reps times each; the best and the median GB/s.

With --model (a GGUF), also the bytes a one-stream token reads (every tensor but an untied token embedding, of
which a token reads one row) and, for each --tpot-ms, the read rate that time per token means and its share of
the best stream rate: whether a server's one-stream TPOT is bound by memory (near 1.0) or by instructions.

    python bench/memory_stream.py
    python bench/memory_stream.py --model ~/.cache/llm-serving/peers/models/bench-llama-1b-Q4_K_M.gguf --tpot-ms 19.1

On a shared host the neighbours' traffic moves these figures from run to run: compare within one run.
Writes JSON (default bench_results/memory_stream.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, write_json  # noqa: E402

READ_LOOP = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static size_t n; static char* buf; static int threads;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void* part(void* arg) {
  size_t per = n / threads; const char* p = buf + (long)arg * per;
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i < per; i += 128) {
    _mm_prefetch(p + i + 4096, _MM_HINT_T1);
    a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i*)(p + i)));
    b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i*)(p + i + 32)));
    c = _mm256_xor_si256(c, _mm256_load_si256((const __m256i*)(p + i + 64)));
    d = _mm256_xor_si256(d, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  volatile int keep = _mm256_extract_epi32(_mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d)), 0);
  (void)keep; return 0;
}
int main(int argc, char** argv) {
  n = (size_t)atol(argv[1]) << 20; threads = atoi(argv[2]); int reps = atoi(argv[3]);
  buf = aligned_alloc(1 << 21, n); madvise(buf, n, MADV_HUGEPAGE); memset(buf, 1, n);
  for (int r = 0; r <= reps; ++r) {
    pthread_t th[64]; double t0 = now();
    for (long i = 0; i < threads; ++i) pthread_create(&th[i], 0, part, (void*)i);
    for (int i = 0; i < threads; ++i) pthread_join(th[i], 0);
    if (r) printf("%.3f\n", n / (now() - t0) / 1e9);      /* the first pass only touches the pages in */
  }
  return 0;
}
"""


def build(work: str) -> str:
    src, exe = os.path.join(work, "read.c"), os.path.join(work, "read")
    Path(src).write_text(READ_LOOP)
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-O2", "-mavx2", "-pthread", src, "-o", exe], check=True)
    return exe


def token_bytes(path: str) -> int:
    """Bytes a one-stream decode token reads from a GGUF: every tensor but the token embedding, unless the
    embedding is also the output matrix (tied: no output.weight), where it is read whole for the logits."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(b for name, b in tensors.items() if tied or name != "token_embd.weight")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=2048, help="buffer size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--model", help="a GGUF: the bytes a one-stream token reads")
    p.add_argument("--tpot-ms", default="", help="with --model: times per token to compare, comma separated")
    p.add_argument("--out", default="bench_results/memory_stream.json")
    args = p.parse_args(argv)
    result = {"scenario": "memory_stream", "machine": machine(), "mib": args.mib}
    with tempfile.TemporaryDirectory() as work:
        exe = build(work)
        for t in sorted({1, args.threads}):
            out = subprocess.run([exe, str(args.mib), str(t), str(args.reps)], check=True, capture_output=True,
                                 text=True).stdout.split()
            rates = [float(v) for v in out]
            result[f"{t}_threads"] = {"best_gb_s": max(rates), "median_gb_s": statistics.median(rates),
                                      "runs": rates}
            print(f"{t} thread(s): best {max(rates):.1f} GB/s, median {statistics.median(rates):.1f} GB/s")
    best = result[f"{args.threads}_threads"]["best_gb_s"]
    if args.model:
        nbytes = token_bytes(args.model)
        result["model"], result["token_bytes"] = args.model, nbytes
        print(f"{Path(args.model).name}: a one-stream token reads {nbytes / 1e6:,.0f} MB "
              f"({nbytes / best / 1e6:.1f} ms at the best rate on {args.threads} threads)")
        result["tpot"] = []
        for ms in (float(v) for v in args.tpot_ms.split(",") if v):
            rate = nbytes / (ms / 1e3) / 1e9
            result["tpot"].append({"tpot_ms": ms, "gb_s": rate, "share_of_best": rate / best})
            print(f"  TPOT {ms:.1f} ms: {rate:.1f} GB/s, {rate / best:.2f} of the best stream rate")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
