// Tensor-parallel all-reduce (sum) over POSIX shared memory: the CPU twin of HCCL's AllReduce.
//
// The agents of one tensor-parallel group map one segment (created by the master; layout in
// llm_serving/shm/comm.py):
//   line 0        magic "LLMSTP01", world, chunk_bytes            (64 bytes)
//   line 1 + r    arrived[r]: the last call rank r has written       (64 bytes each, one cache line per rank)
//   data          slot[parity][rank]: chunk_bytes each, parity = call & 1
// Call k of every rank (the ranks run the same graphs in the same order, so their k agree): write this
// rank's piece into slot[k & 1][rank], publish arrived[rank] = k (release), wait until every rank has
// arrived at k (acquire), then sum the W slots in rank order, so every rank gets the same bits. Two
// parities make a barrier per call enough: a rank that reaches call k + 2 (reusing a slot) has seen every
// rank arrive at k + 1, which each did only after reading its slots of call k. Tensors larger than a slot
// go as several calls.
//
// Waiting spins (pause) for a few microseconds, then yields the core; a rank that does not arrive within
// the timeout fails the call (the kernel returns non-zero, MindSpore raises) and poisons the state: the
// group's counters no longer agree, so every later call fails at once until the agent is restarted.
//
// Entry points: TpAttach (from Python via ctypes, in the same process and the same .so file MindSpore
// loads, so both see these globals; it maps the segment for the life of the process), TpSetTimeout,
// TpLastError, TpCalls, and ShmAllReduce, the `ops.Custom` AOT kernel: one float32 input of any shape, one
// output of the same shape.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr uint64_t kMagic = 0x31305054534d4c4cULL;   // "LLMSTP01", little-endian
constexpr int64_t kLine = 64;

struct State {
  uint8_t* base = nullptr;
  int rank = 0;
  int world = 1;
  int64_t chunk = 0;          // bytes per slot
  uint64_t calls = 0;         // calls made by this rank
  double timeout_s = 120.0;
  bool broken = false;
  char error[512] = "";
};
State g;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline uint64_t* arrived(int r) { return reinterpret_cast<uint64_t*>(g.base + kLine * (1 + r)); }

inline float* slot(uint64_t call, int r) {
  const int64_t data = kLine * (1 + g.world);
  return reinterpret_cast<float*>(g.base + data + (static_cast<int64_t>(call & 1) * g.world + r) * g.chunk);
}

// Wait until every rank has published `call`; false (with g.error set) on timeout.
bool wait_all(uint64_t call) {
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < g.world; ++r) {
    uint64_t spins = 0;
    while (__atomic_load_n(arrived(r), __ATOMIC_ACQUIRE) < call) {
      if (++spins < 2048) {
        cpu_relax();
        continue;
      }
      sched_yield();
      if ((spins & 255) == 0) {
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > g.timeout_s) {
          std::snprintf(g.error, sizeof g.error,
                        "tensor-parallel all-reduce: rank %d waited %.0f s for rank %d at call %llu (it is dead, "
                        "hung or out of step)", g.rank, waited, r, static_cast<unsigned long long>(call));
          return false;
        }
      }
    }
  }
  return true;
}

}  // namespace

// Map the POSIX shared-memory segment `name` (kept mapped until the process exits) as rank `rank` of
// `world`. Returns 0, or non-zero with TpLastError() saying why.
extern "C" int TpAttach(const char* name, int rank, int world, double timeout_s) {
  if (g.base != nullptr) {
    std::snprintf(g.error, sizeof g.error, "tensor-parallel segment: this process is already attached");
    return 1;
  }
  const int fd = shm_open(name, O_RDWR, 0);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    std::snprintf(g.error, sizeof g.error, "tensor-parallel segment %s: cannot open it", name);
    if (fd >= 0) close(fd);
    return 1;
  }
  void* base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    std::snprintf(g.error, sizeof g.error, "tensor-parallel segment %s: cannot map it", name);
    return 1;
  }
  const auto* head = static_cast<const uint64_t*>(base);
  const int64_t size = static_cast<int64_t>(st.st_size);
  if (size < kLine || head[0] != kMagic || static_cast<int64_t>(head[1]) != world || rank < 0 || rank >= world ||
      head[2] == 0 || head[2] % kLine != 0 ||
      size < kLine * (1 + world) + 2 * world * static_cast<int64_t>(head[2])) {
    std::snprintf(g.error, sizeof g.error, "tensor-parallel segment %s: not a segment for rank %d of %d", name,
                  rank, world);
    munmap(base, static_cast<size_t>(st.st_size));
    return 1;
  }
  g.base = static_cast<uint8_t*>(base);
  g.rank = rank;
  g.world = world;
  g.chunk = static_cast<int64_t>(head[2]);
  g.calls = 0;
  g.timeout_s = timeout_s;
  g.broken = false;
  g.error[0] = '\0';
  return 0;
}

extern "C" void TpSetTimeout(double timeout_s) { g.timeout_s = timeout_s; }

extern "C" const char* TpLastError() { return g.error; }

extern "C" uint64_t TpCalls() { return g.calls; }

extern "C" int ShmAllReduce(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (g.base == nullptr) {
    std::snprintf(g.error, sizeof g.error, "tensor-parallel all-reduce called before TpAttach");
    return 1;
  }
  if (g.broken) return 2;   // g.error still says why
  g.error[0] = '\0';        // a reason only ever describes the call that failed
  if (nparam != 2 || std::strcmp(dtypes[0], "float32") != 0) {
    std::snprintf(g.error, sizeof g.error, "tensor-parallel all-reduce: expected one float32 input");
    return 1;
  }
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const auto* in = static_cast<const float*>(params[0]);
  auto* out = static_cast<float*>(params[1]);
  const int64_t per_call = g.chunk / static_cast<int64_t>(sizeof(float));
  for (int64_t off = 0; off < n; off += per_call) {
    const int64_t m = n - off < per_call ? n - off : per_call;
    const uint64_t call = ++g.calls;
    std::memcpy(slot(call, g.rank), in + off, m * sizeof(float));
    __atomic_store_n(arrived(g.rank), call, __ATOMIC_RELEASE);
    if (!wait_all(call)) {
      g.broken = true;
      return 3;
    }
    float* dst = out + off;
    const float* first = slot(call, 0);
    for (int64_t i = 0; i < m; ++i) dst[i] = first[i];
    for (int r = 1; r < g.world; ++r) {
      const float* src = slot(call, r);
      for (int64_t i = 0; i < m; ++i) dst[i] += src[i];
    }
  }
  return 0;
}
