// Decode attention on the CPU that reads the paged KV pool in place through the block tables:
// no gather of a sequence's blocks into a copy, no mask tensor. Each slot's K and V rows are
// read once per step for all heads. head_dim a multiple of 16, at most 256.
//
// Registered as torch.ops.pdserve_cpu.paged_decode_attention (schema below); built and loaded
// at run time by workers/model/cpu_kernels.py, which falls back to gather + SDPA without it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

using pdserve_vec::exp16;

// 16 floats in one vector (GCC vector extension: one zmm register with AVX-512, two ymm with
// AVX2): head_dim is processed 16 lanes at a time, keys and values converted to fp32 on load.
typedef float vf16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxChunks = 16;  // head_dim <= 256
// K elements a step must read before its sequences are split over threads (a wake-up of torch's
// pool costs about as much as reading this many on one core).
constexpr int64_t kParallelElems = 1 << 16;

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf16 load16(const c10::BFloat16* p) {  // bf16 is the high half of an fp32
  vh16 h;
  std::memcpy(&h, p, sizeof(h));
  vu16 u = __builtin_convertvector(h, vu16) << 16;
  vf16 v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline vf16 load16(const c10::Half* p) {
  float f[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) f[t] = static_cast<float>(p[t]);
  return load16(f);
}

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

inline float hsum(vf16 v) {  // a shuffle tree: 16 -> 8 -> 4 -> 2 -> 1 lanes
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1];
}

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& layer_kv, const at::Tensor& token_index,
                   const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                   at::Tensor& out) {
  const int64_t n = tables.size(0), max_blocks = tables.size(1);
  const int64_t h = q.size(1), d = q.size(2);
  const int64_t num_blocks = layer_kv.size(1), B = layer_kv.size(2), kvh = layer_kv.size(3);
  const int64_t group = h / kvh, chunks = d / kLanes;
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = layer_kv.data_ptr<T>();
  const T* vp = kp + num_blocks * B * kvh * d;  // plane 1
  T* op = out.data_ptr<T>();
  const int64_t* rows = token_index.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const bool pow2 = (B & (B - 1)) == 0;
  const int shift = pow2 ? __builtin_ctzll(static_cast<unsigned long long>(B)) : 0;
  const int64_t slot_elems = kvh * d;  // one slot's K (or V) row: every KV head, contiguous

  // One sequence at a time, all its heads together: each slot's K and V rows (all KV heads,
  // contiguous) are read once per step, which is what bounds this kernel (memory traffic).
  // Sequences are split over torch's threads (at::parallel_for: torch's own OpenMP pool, so
  // torch.set_num_threads holds; this file links no runtime of its own, see cpu_kernels.py),
  // but only when the step reads enough keys to pay for waking them.
  int64_t keys = 0;
  for (int64_t i = 0; i < n; ++i) keys += window > 0 ? std::min<int64_t>(len_p[i], window) : len_p[i];
  const int64_t grain = keys * slot_elems >= kParallelElems ? 1 : n + 1;  // n + 1: inline, no pool
  at::parallel_for(0, n, grain, [&](int64_t seq_begin, int64_t seq_end) {
    std::vector<float> scores;
    std::vector<vf16> qv(h * chunks), acc(h * chunks);
    for (int64_t i = seq_begin; i < seq_end; ++i) {
      const int64_t len = len_p[i];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t L = len - lo;
      const int64_t* table = tab + i * max_blocks;
      auto slot_of = [&](int64_t p) {
        const int64_t blk = pow2 ? table[p >> shift] : table[p / B];
        return blk * B + (pow2 ? (p & (B - 1)) : p % B);
      };
      for (int64_t a = 0; a < h; ++a) {
        const T* src = qp + rows[i] * q_row + a * q_head;
        for (int64_t c = 0; c < chunks; ++c) qv[a * chunks + c] = load16(src + c * kLanes) * sc;
      }
      scores.resize(h * L);
      // Scores: slot by slot, every head.
      for (int64_t p = lo; p < len; ++p) {
        const T* krow = kp + slot_of(p) * slot_elems;
        for (int64_t g = 0; g < kvh; ++g) {
          vf16 kc[kMaxChunks];
          for (int64_t c = 0; c < chunks; ++c) kc[c] = load16(krow + g * d + c * kLanes);
          for (int64_t a = g * group; a < (g + 1) * group; ++a) {
            const vf16* qa = qv.data() + a * chunks;
            vf16 s = qa[0] * kc[0];
            for (int64_t c = 1; c < chunks; ++c) s += qa[c] * kc[c];
            scores[a * L + (p - lo)] = hsum(s);
          }
        }
      }
      // Softmax per query head (max-subtracted, fp32; 16 keys at a time, the rest one by one).
      for (int64_t a = 0; a < h; ++a) {
        float* sa = scores.data() + a * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < L; ++j) m = std::max(m, sa[j]);
        vf16 sum16{};
        int64_t j = 0;
        for (; j + kLanes <= L; j += kLanes) {
          vf16 e = exp16(load16(sa + j) - m);
          std::memcpy(sa + j, &e, sizeof(e));
          sum16 += e;
        }
        float sum = hsum(sum16);
        for (; j < L; ++j) {
          sa[j] = std::exp(sa[j] - m);
          sum += sa[j];
        }
        const float inv = 1.f / sum;
        for (int64_t k = 0; k < L; ++k) sa[k] *= inv;
      }
      // Weighted values: slot by slot, every head.
      std::fill(acc.begin(), acc.end(), vf16{});
      for (int64_t p = lo; p < len; ++p) {
        const T* vrow = vp + slot_of(p) * slot_elems;
        for (int64_t g = 0; g < kvh; ++g) {
          vf16 vc[kMaxChunks];
          for (int64_t c = 0; c < chunks; ++c) vc[c] = load16(vrow + g * d + c * kLanes);
          for (int64_t a = g * group; a < (g + 1) * group; ++a) {
            const float w = scores[a * L + (p - lo)];
            vf16* acc_a = acc.data() + a * chunks;
            for (int64_t c = 0; c < chunks; ++c) acc_a[c] += w * vc[c];
          }
        }
      }
      for (int64_t a = 0; a < h; ++a) {
        T* dst = op + rows[i] * o_row + a * o_head;
        for (int64_t c = 0; c < chunks; ++c)
          for (int64_t t = 0; t < kLanes; ++t) dst[c * kLanes + t] = static_cast<T>(acc[a * chunks + c][t]);
      }
    }
  });
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& layer_kv, const at::Tensor& token_index,
                            const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                            at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && layer_kv.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, heads, head_dim] with unit last stride");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "out must match q");
  TORCH_CHECK(layer_kv.dim() == 5 && layer_kv.size(0) == 2 && layer_kv.is_contiguous(),
              "layer_kv must be a contiguous [2, num_blocks, B, kv_heads, head_dim] pool");
  TORCH_CHECK(layer_kv.size(4) == q.size(2) && q.size(1) % layer_kv.size(3) == 0, "head shapes disagree");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kLanes * kMaxChunks, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(q.scalar_type() == layer_kv.scalar_type() && out.scalar_type() == q.scalar_type(), "dtypes differ");
  TORCH_CHECK(token_index.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong && tables.is_contiguous() && token_index.is_contiguous() &&
                  lens.is_contiguous(),
              "token_index, tables and lens must be contiguous int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == lens.size(0) && token_index.size(0) == lens.size(0),
              "one table, length and row per sequence");
  switch (q.scalar_type()) {
    case at::kFloat: decode_kernel<float>(q, layer_kv, token_index, tables, lens, scale, window, out); break;
    case at::kBFloat16: decode_kernel<c10::BFloat16>(q, layer_kv, token_index, tables, lens, scale, window, out); break;
    case at::kHalf: decode_kernel<c10::Half>(q, layer_kv, token_index, tables, lens, scale, window, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor layer_kv, Tensor token_index, Tensor tables, Tensor lens, "
        "float scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
