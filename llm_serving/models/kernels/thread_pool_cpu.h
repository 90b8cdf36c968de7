// decoder_layer_cpu.cc's threads: a persistent pool (the calling thread and `threads - 1` workers) that stays
// between kernels, so that each kernel is one dispatch and a few spin barriers, not a thread start per call. A
// product's output rows are handed out in chunks to whichever thread is free (`claim_rows`), and a barrier's
// waiter yields its core after a short spin: on two cores shared with the master and a load client, one thread
// losing its core for a while then delays a step by a chunk, not by half of every product.
//
// Like every *_cpu.h part of that kernel: in an anonymous namespace, included by decoder_layer_cpu.cc only.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// How long an idle worker spins for the next kernel before it sleeps: the kernels of one step follow each
// other within tens of microseconds; between steps the worker sleeps (and leaves the core to the master).
int64_t spin_microseconds() {
  const char* env = std::getenv("LLM_SERVING_KERNEL_SPIN_US");
  return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : 300;
}

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    if (n_ == 1) return;
    const int phase = phase_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
    } else {
      // spin, then give the core away between looks: on a machine where other processes run too (the master,
      // a load client) the thread being waited for may be the one without a core
      for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
        if (spins < 4096) {
          cpu_relax();
        } else {
          std::this_thread::yield();
        }
      }
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> phase_{0};
};

// A pool's scratch space, reused from call to call (grown on demand); guarded by the pool's call mutex.
struct Scratch {
  std::vector<float> qkv, attn, act, normed, scores, tiles, lora, lora_gate_up;
  std::vector<float> attn_tiles;                 // per thread: attend_tile's query, output and key tiles
  std::vector<float> packed, gemm_w, gemm_c;     // gemm_cpu.h: x's panels (shared), per thread weights and C
  std::vector<float> silu;                       // per thread: one unit's gate, up and f(gate) * up, every row
  std::vector<float> up;                         // batch-invariant steps of few rows: up's sums (rows x I)
  std::vector<float> sandwich;                   // sandwich norms: the o product's result, then the down one's
  static float* sized(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

// The calling thread is thread 0; workers 1..n-1 run the same job with their own index. run() returns when
// every thread has finished the job. One job at a time (a mutex), so kernels called from several threads
// take turns.
class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)), spin_us_(spin_microseconds()) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t, 0); });
  }
  int threads() const { return threads_; }
  std::mutex& call_mutex() { return call_; }
  Scratch& scratch() { return scratch_; }

  // job(tid, nthreads); the caller holds call_mutex(). last_of_step: no kernel follows soon (the step's
  // last), so the workers sleep as soon as they finish instead of spinning: the cores go to the processes
  // that handle the step's results (the agent's own Python, the master).
  void run(const std::function<void(int, int)>& job, bool last_of_step = false) {
    if (threads_ == 1) {
      job(0, 1);
      return;
    }
    job_ = &job;
    spin_next_us_ = last_of_step ? 0 : spin_us_;
    done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    job(0, threads_);
    while (done_.load(std::memory_order_acquire) != threads_ - 1) cpu_relax();
  }

 private:
  // `seen` is the generation the worker was created at (0: the pool's first), so a job dispatched before the
  // worker first looks is not missed.
  void work(int tid, uint64_t seen) {
    int64_t spin_us = spin_us_;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      int64_t spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        cpu_relax();
        if ((++spins & 255) == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us)) {
          std::unique_lock<std::mutex> lock(sleep_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          break;
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      spin_us = spin_next_us_;                      // written before the generation was published
      (*job_)(tid, threads_);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  const int threads_;
  const int64_t spin_us_;
  std::vector<std::thread> workers_;
  std::mutex call_;
  Scratch scratch_;
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> done_{0};
  const std::function<void(int, int)>* job_ = nullptr;
  int64_t spin_next_us_ = 0;          // how long workers spin after the current job
};

// One pool per thread count in the process (a server uses one), made by the first call that asks for it and
// never destroyed: its workers sleep until the process exits. A child forked from a process that has pools
// has none of their workers, so it starts with no pools (the parent's are forgotten, never run).
std::mutex* pools_mutex = new std::mutex();
std::vector<Pool*>* pools = new std::vector<Pool*>();

Pool& pool(int threads) {
  static const bool fork_handler = [] {
    pthread_atfork(nullptr, nullptr, [] {
      pools_mutex = new std::mutex();
      pools = new std::vector<Pool*>();
    });
    return true;
  }();
  (void)fork_handler;
  std::lock_guard<std::mutex> lock(*pools_mutex);
  for (Pool* p : *pools) {
    if (p->threads() == threads) return *p;
  }
  pools->push_back(new Pool(threads));
  return *pools->back();
}

// Rows [0, n) of a product handed out in chunks of whole tiles (about 8 per thread) to whichever thread asks
// next: fn(begin, end) per chunk. A thread that runs slower (its core shared with the master or a client) takes
// fewer chunks, so the barrier after waits for one chunk of it, not for the rest of a fixed half.
// align: chunks are whole multiples of it (4: matvec's tiles; a gemm group's rows for the batched path).
inline int64_t chunk_rows(int64_t n, int threads, int64_t align = 4) {
  return threads == 1 ? n : std::max<int64_t>(std::max<int64_t>(16, align), (n / (8 * threads) + align - 1) / align * align);
}

template <typename F>
void claim_rows(std::atomic<int64_t>& next, int64_t n, int threads, F&& fn, int64_t align = 4) {
  const int64_t chunk = chunk_rows(n, threads, align);
  for (int64_t r0 = next.fetch_add(chunk); r0 < n; r0 = next.fetch_add(chunk)) fn(r0, std::min(n, r0 + chunk));
}

}  // namespace
