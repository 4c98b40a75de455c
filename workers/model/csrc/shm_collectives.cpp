// All-reduce (sum) and all-gather for the ranks of one CPU worker group, through a shared-memory
// segment instead of gloo's TCP loopback (a ~1.3 ms gloo all-reduce of a decode activation was
// 77 % of a TP 2 decode step on the 2-core VM).
//
// Segment (one file in /dev/shm, made by rank 0 and mapped by every rank; shm_group.py unlinks
// the name once every rank has mapped it, so nothing outlives the processes):
//   Header | RankLine[size] | slots: rank r's buffer p (p = seq parity) at (2 r + p) * slot_bytes
// A call (every rank makes the same calls in the same order) numbered s = 1, 2, ...:
//   1. copy the input into the own slot of parity s & 1, then publish seq[rank] = s (release);
//   2. wait until every rank's seq >= s (acquire): every slot of parity s & 1 holds call s's data;
//   3. read the slots: the sum in rank order 0..N-1 (so every rank computes bitwise the same
//      result), or the concatenation for the gather.
// Two buffers alternating by parity make one barrier per call enough: a rank writes its parity-p
// buffer again at call s + 2 only after its wait in call s + 1 saw every peer publish s + 1, and
// a peer publishes s + 1 only after it finished reading call s.
//
// Every wait has a deadline (the group's timeout) and notices a peer process that is gone; either
// poisons the group (a flag in the header, so the peers fail at once too), and every later call
// raises. Called through torch.ops, these run without the GIL (torch releases it around an op
// call), so other Python threads of the worker go on while a rank waits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr uint64_t kMagic = 0x70647368'6d677270ULL;  // "pdshmgrp"
constexpr uint32_t kVersion = 1;
constexpr int64_t kMaxRanks = 64;
constexpr int64_t kSpins = 1024;             // pause-spins before yielding the core
constexpr double kYieldSeconds = 0.002;      // then sched_yield; past this, short sleeps
constexpr double kLivenessEvery = 0.1;       // seconds between checks that waited-on peers live
constexpr int64_t kChunk = 1024;             // elements summed per pass (fp32 scratch on the stack)

struct alignas(128) Header {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t slot_bytes;
  std::atomic<int32_t> poisoned;  // 0, or 1 + the rank that poisoned it (its reason in its line)
};

struct RankLine {
  alignas(128) std::atomic<uint64_t> seq;  // alone in its 128 bytes: every peer polls it
  alignas(128) int32_t pid;
  uint64_t start_time;  // the process's, from /proc (0: unknown, never watched)
  char reason[240];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");

size_t data_offset(int64_t size) {
  const size_t head = sizeof(Header) + size * sizeof(RankLine);
  return (head + 4095) & ~size_t(4095);
}

struct Group {
  std::string path;
  int64_t rank = 0, size = 0;
  size_t slot_bytes = 0, bytes = 0;
  double timeout_s = 0;
  uint8_t* base = nullptr;
  Header* hdr = nullptr;
  RankLine* lines = nullptr;
  uint8_t* data = nullptr;
  uint64_t seq = 0;
  std::string poison;               // this process's copy of why the group is unusable
  std::vector<char> watch;          // per peer: its process is visible here (liveness checkable)
  std::mutex mu;                    // one collective at a time per group

  uint8_t* slot(int64_t r, uint64_t s) const { return data + (2 * r + (s & 1)) * slot_bytes; }
  ~Group() {
    if (base != nullptr) munmap(base, bytes);
  }
};

std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<Group>> registry;
int64_t next_handle = 1;

std::shared_ptr<Group> lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(handle);
  TORCH_CHECK(it != registry.end(), "shared-memory group ", handle, " is closed");
  return it->second;
}

// A process's state and start time (clock ticks after boot) from /proc/<pid>/stat: the fields
// after the command's closing ')' are state (3rd field) ... starttime (22nd). The start time
// tells a reused pid, or another pid namespace's process of that number, from the peer itself.
bool proc_stat(int32_t pid, char* state, uint64_t* start) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  unsigned long long t = 0;
  if (std::sscanf(p + 1, " %c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu",
                  state, &t) != 2) {
    return false;
  }
  *start = t;
  return true;
}

// The peer process still runs: same start time, and not a zombie (a killed child of rank 0
// stays one until it is reaped, and kill(pid, 0) still succeeds on it).
bool peer_alive(int32_t pid, uint64_t start) {
  char state = 0;
  uint64_t t = 0;
  return proc_stat(pid, &state, &t) && t == start && state != 'Z' && state != 'X';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

[[noreturn]] void poison(Group& g, const std::string& why) {
  RankLine& own = g.lines[g.rank];
  std::snprintf(own.reason, sizeof(own.reason), "%s", why.c_str());
  int32_t expected = 0;  // the first rank to poison it names the cause
  g.hdr->poisoned.compare_exchange_strong(expected, static_cast<int32_t>(g.rank + 1), std::memory_order_release);
  g.poison = why;
  TORCH_CHECK(false, why);
}

void check_poisoned(Group& g) {
  TORCH_CHECK(g.poison.empty(), "shared-memory group unusable: ", g.poison);
  const int32_t by = g.hdr->poisoned.load(std::memory_order_acquire);
  if (by != 0) {
    g.poison = "rank " + std::to_string(by - 1) + " failed: " +
               std::string(g.lines[by - 1].reason, strnlen(g.lines[by - 1].reason, sizeof(RankLine::reason)));
    TORCH_CHECK(false, "shared-memory group unusable: ", g.poison);
  }
}

std::string missing_ranks(const Group& g, uint64_t target) {
  std::string out;
  for (int64_t j = 0; j < g.size; ++j) {
    if (g.lines[j].seq.load(std::memory_order_acquire) < target) out += (out.empty() ? "" : ", ") + std::to_string(j);
  }
  return out;
}

// Step 2 above: every rank's seq >= target, within the deadline.
void wait_all(Group& g, uint64_t target) {
  auto arrived = [&] {
    for (int64_t j = 0; j < g.size; ++j) {
      if (g.lines[j].seq.load(std::memory_order_acquire) < target) return false;
    }
    return true;
  };
  if (arrived()) return;
  if (g.watch.empty()) {  // first wait: every rank attached before the first call
    g.watch.resize(g.size);
    for (int64_t j = 0; j < g.size; ++j) g.watch[j] = j != g.rank && g.lines[j].start_time != 0 &&
                                                    peer_alive(g.lines[j].pid, g.lines[j].start_time);
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  double next_liveness = kLivenessEvery;
  for (int64_t it = 1;; ++it) {
    if (arrived()) return;
    if (it < kSpins) {
      cpu_relax();
      if (it % 128) continue;
    }
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    check_poisoned(g);
    if (waited > g.timeout_s) {
      char secs[32];
      std::snprintf(secs, sizeof(secs), "%g", g.timeout_s);
      poison(g, "rank(s) " + missing_ranks(g, target) + " of the shared-memory group did not reach collective " +
                    std::to_string(target) + " within " + secs + " s (rank " + std::to_string(g.rank) + " waited)");
    }
    if (waited > next_liveness) {
      next_liveness = waited + kLivenessEvery;
      for (int64_t j = 0; j < g.size; ++j) {
        if (g.watch[j] && g.lines[j].seq.load(std::memory_order_acquire) < target && !peer_alive(g.lines[j].pid, g.lines[j].start_time)) {
          poison(g, "rank " + std::to_string(j) + " (pid " + std::to_string(g.lines[j].pid) +
                        ") of the shared-memory group exited");
        }
      }
    }
    if (it < kSpins) continue;
    if (waited < kYieldSeconds) {
      sched_yield();  // a 2-core box runs both ranks and more: let a peer have this core
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));  // a long wait: stop burning a core
    }
  }
}

// Steps 1 and 2: this rank's bytes into its slot, published, every peer's awaited.
void exchange(Group& g, const void* src, size_t nbytes) {
  check_poisoned(g);
  const uint64_t s = g.seq + 1;
  std::memcpy(g.slot(g.rank, s), src, nbytes);
  g.lines[g.rank].seq.store(s, std::memory_order_release);
  g.seq = s;
  wait_all(g, s);
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

// out = slot 0 + slot 1 + ... + slot N-1, element by element in that order. fp32 adds in place;
// bf16/fp16 are summed in fp32 and rounded once.
template <typename T>
void sum_slots(const Group& g, uint64_t s, T* out, int64_t n) {
  std::vector<const T*> src(g.size);
  for (int64_t j = 0; j < g.size; ++j) src[j] = reinterpret_cast<const T*>(g.slot(j, s));
  float acc[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    const T* a = src[0] + i0;
    for (int64_t i = 0; i < len; ++i) acc[i] = widen(a[i]);
    for (int64_t j = 1; j < g.size; ++j) {
      const T* b = src[j] + i0;
      for (int64_t i = 0; i < len; ++i) acc[i] += widen(b[i]);
    }
    T* o = out + i0;
    for (int64_t i = 0; i < len; ++i) o[i] = static_cast<T>(acc[i]);
  }
}

void check_tensor(const Group& g, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "shared-memory collectives take contiguous CPU tensors");
  TORCH_CHECK(static_cast<size_t>(x.nbytes()) <= g.slot_bytes, "a tensor of ", x.nbytes(),
              " bytes does not fit the shared-memory slot (", g.slot_bytes, " bytes)");
}

// ----------------------------------------------------------------- ops

int64_t shm_group_open(std::string path, int64_t rank, int64_t size, int64_t slot_bytes, double timeout_s) {
  TORCH_CHECK(size >= 1 && size <= kMaxRanks && rank >= 0 && rank < size, "bad rank ", rank, " of ", size);
  TORCH_CHECK(slot_bytes > 0 && timeout_s > 0, "bad slot size or timeout");
  auto g = std::make_shared<Group>();
  g->path = std::move(path);
  g->rank = rank;
  g->size = size;
  g->slot_bytes = (static_cast<size_t>(slot_bytes) + 4095) & ~size_t(4095);  // page-aligned slots
  g->bytes = data_offset(size) + 2 * size * g->slot_bytes;
  g->timeout_s = timeout_s;
  const bool create = rank == 0;
  const int fd = open(g->path.c_str(), create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "cannot open ", g->path, ": ", std::strerror(errno));
  if (create) {
    // Reserve every page now: a tmpfs that is too small fails here (and the group uses gloo)
    // rather than with SIGBUS at the first touch of a page mid-step.
    const int err = posix_fallocate(fd, 0, static_cast<off_t>(g->bytes));
    if (err != 0) {
      close(fd);
      unlink(g->path.c_str());
      TORCH_CHECK(false, "cannot reserve ", g->bytes, " bytes in ", g->path, ": ", std::strerror(err));
    }
  } else {
    struct stat st;
    const bool ok = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == g->bytes;
    if (!ok) close(fd);
    TORCH_CHECK(ok, g->path, " is not a segment of this group's shape (", g->bytes, " bytes)");
  }
  void* base = mmap(nullptr, g->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mapping keeps the segment
  TORCH_CHECK(base != MAP_FAILED, "cannot map ", g->path, ": ", std::strerror(errno));
  g->base = static_cast<uint8_t*>(base);
  g->hdr = reinterpret_cast<Header*>(g->base);
  g->lines = reinterpret_cast<RankLine*>(g->base + sizeof(Header));
  g->data = g->base + data_offset(size);
  if (create) {  // fallocate zeroed it: every seq starts at 0; the peers read this after the store
    g->hdr->magic = kMagic;
    g->hdr->version = kVersion;
    g->hdr->size = static_cast<uint32_t>(size);
    g->hdr->slot_bytes = g->slot_bytes;
  }
  TORCH_CHECK(g->hdr->magic == kMagic && g->hdr->version == kVersion && g->hdr->size == size &&
                  g->hdr->slot_bytes == g->slot_bytes,
              g->path, " holds a different group's segment");
  char state = 0;
  uint64_t start = 0;
  g->lines[rank].pid = static_cast<int32_t>(getpid());
  g->lines[rank].start_time = proc_stat(getpid(), &state, &start) ? start : 0;
  std::lock_guard<std::mutex> lock(registry_mu);
  registry[next_handle] = g;
  return next_handle++;
}

void shm_group_close(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mu);
  registry.erase(handle);  // unmapped when no call holds it any more
}

void shm_all_reduce(int64_t handle, at::Tensor x) {
  auto g = lookup(handle);
  std::lock_guard<std::mutex> lock(g->mu);
  check_tensor(*g, x);
  exchange(*g, x.data_ptr(), x.nbytes());
  const int64_t n = x.numel();
  switch (x.scalar_type()) {
    case at::kFloat: sum_slots(*g, g->seq, x.data_ptr<float>(), n); break;
    case at::kBFloat16: sum_slots(*g, g->seq, x.data_ptr<c10::BFloat16>(), n); break;
    case at::kHalf: sum_slots(*g, g->seq, x.data_ptr<c10::Half>(), n); break;
    default: TORCH_CHECK(false, "shared-memory all-reduce sums float32, bfloat16 and float16, not ", x.scalar_type());
  }
}

// Every rank's [..., k] -> [..., size * k], rank j's part at columns [j k, (j + 1) k).
at::Tensor shm_all_gather(int64_t handle, const at::Tensor& x) {
  auto g = lookup(handle);
  std::lock_guard<std::mutex> lock(g->mu);
  check_tensor(*g, x);
  TORCH_CHECK(x.dim() >= 1, "all-gather of a scalar");
  std::vector<int64_t> shape = x.sizes().vec();
  const int64_t k = shape.back();
  shape.back() = k * g->size;
  at::Tensor out = at::empty(shape, x.options());
  exchange(*g, x.data_ptr(), x.nbytes());
  const size_t row = k * x.element_size();
  const int64_t rows = k == 0 ? 0 : x.numel() / k;
  auto* o = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t j = 0; j < g->size; ++j) {
    const uint8_t* src = g->slot(j, g->seq);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(o + (r * g->size + j) * row, src + r * row, row);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("shm_group_open(str path, int rank, int size, int slot_bytes, float timeout_s) -> int", &shm_group_open);
  m.def("shm_group_close(int handle) -> ()", &shm_group_close);
  m.def("shm_all_reduce(int handle, Tensor(a!) x) -> ()");
  m.def("shm_all_gather(int handle, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("shm_all_reduce", &shm_all_reduce);
  m.impl("shm_all_gather", &shm_all_gather);
}
