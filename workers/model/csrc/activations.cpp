// Elementwise steps of a decoder layer as one op each on the CPU, where torch runs several:
//
// - silu_mul(gate_up, I): act = silu(gate) * up over the fused gate/up projection [T, 2I],
//   written to a fresh contiguous [T, I] (torch: silu in place on a strided view, then mul_,
//   and the down projection copies the strided result to contiguous rows first).
// - rope_store(qkv, cos, sin, slots, layer_kv, heads): RoPE in place on the q and k heads of
//   [T, heads + 2 * kv_heads, d], then k and v written to the KV pool at `slots` (torch: six
//   elementwise ops and two index_copy_).
//
// Arithmetic follows the torch ops they replace, rounding where those round: silu is
// x / (1 + exp(-x)) in fp32 (in bf16/fp16: widened, computed in fp32, rounded, then multiplied
// by up and rounded again); RoPE is [x1 c - x2 s, x2 c + x1 s] with every product rounded
// before the sum (no FMA contraction in that function). exp is vec_math.h's (about 1 ulp from
// the libm/Sleef exp torch uses).
//
// Registered as torch.ops.pdserve_cpu.silu_mul / rope_store, in the extension cpu_kernels.py
// builds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

using pdserve_vec::exp16;
using pdserve_vec::vf16;
constexpr int64_t kLanes = 16;

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T narrow(float v) { return static_cast<T>(v); }

// silu over n floats: 16 lanes at a time through exp16, the tail through the same lanes.
inline void silu_floats(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - i);
    vf16 v{};
    std::memcpy(&v, x + i, m * sizeof(float));
    const vf16 s = v / (1.f + exp16(-v));
    std::memcpy(y + i, &s, m * sizeof(float));
  }
}

template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, int64_t inter, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), in_stride = gate_up.stride(0);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), s(inter);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * in_stride;
      const T* up = gate + inter;
      T* o = dst + r * inter;
      for (int64_t i = 0; i < inter; ++i) g[i] = widen(gate[i]);
      silu_floats(g.data(), s.data(), inter);
      for (int64_t i = 0; i < inter; ++i) {
        if constexpr (std::is_same_v<T, float>) {
          o[i] = s[i] * up[i];
        } else {  // silu rounded to T (torch's silu output), then the product rounded again
          o[i] = narrow<T>(widen(narrow<T>(s[i])) * widen(up[i]));
        }
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul: CPU tensors only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * intermediate,
              "silu_mul: gate_up must be [rows, 2 * intermediate] with unit last stride");
  at::Tensor out = at::empty({gate_up.size(0), intermediate}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_mul_rows<float>(gate_up, intermediate, out); break;
    case at::kBFloat16: silu_mul_rows<c10::BFloat16>(gate_up, intermediate, out); break;
    case at::kHalf: silu_mul_rows<c10::Half>(gate_up, intermediate, out); break;
    default: TORCH_CHECK(false, "silu_mul: unsupported dtype ", gate_up.scalar_type());
  }
  return out;
}

// One head: x [d] rotated in place by c, s [d / 2]. Products are rounded before the sums (the
// order of torch's x1.mul_(cos).sub_(x2 * sin)); contraction into FMAs is off for this function.
template <typename T>
__attribute__((optimize("fp-contract=off"))) inline void rotate_head(T* x, const T* c, const T* s, int64_t half) {
  T* x1 = x;
  T* x2 = x + half;
  for (int64_t i = 0; i < half; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      const float a1 = x1[i] * c[i], b1 = x2[i] * s[i];
      const float a2 = x2[i] * c[i], b2 = x1[i] * s[i];
      x1[i] = a1 - b1;
      x2[i] = a2 + b2;
    } else {
      const float a1 = widen(narrow<T>(widen(x1[i]) * widen(c[i])));
      const float b1 = widen(narrow<T>(widen(x2[i]) * widen(s[i])));
      const float a2 = widen(narrow<T>(widen(x2[i]) * widen(c[i])));
      const float b2 = widen(narrow<T>(widen(x1[i]) * widen(s[i])));
      x1[i] = narrow<T>(a1 - b1);
      x2[i] = narrow<T>(a2 + b2);
    }
  }
}

template <typename T>
void rope_store_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     at::Tensor& layer_kv, int64_t heads) {
  const int64_t rows = qkv.size(0), all = qkv.size(1), d = qkv.size(2), half = d / 2;
  const int64_t kvh = (all - heads) / 2, slot_elems = kvh * d;
  const int64_t pool_slots = layer_kv.size(1) * layer_kv.size(2);
  T* x = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kpool = layer_kv.data_ptr<T>();
  T* vpool = kpool + pool_slots * slot_elems;
  const int64_t row_stride = qkv.stride(0), cs_stride = cos.stride(0), ss_stride = sin.stride(0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < pool_slots, "rope_store: slot ", slot[r], " outside the pool");
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(all * d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = x + r * row_stride;
      for (int64_t a = 0; a < heads + kvh; ++a) rotate_head(row + a * d, cp + r * cs_stride, sp + r * ss_stride, half);
      std::memcpy(kpool + slot[r] * slot_elems, row + heads * d, slot_elems * sizeof(T));
      std::memcpy(vpool + slot[r] * slot_elems, row + (heads + kvh) * d, slot_elems * sizeof(T));
    }
  });
}

void rope_store(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                at::Tensor layer_kv, int64_t heads) {
  TORCH_CHECK(qkv.device().is_cpu() && layer_kv.device().is_cpu(), "rope_store: CPU tensors only");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2),
              "rope_store: qkv must be [T, heads + 2 * kv_heads, d] with contiguous rows");
  const int64_t rows = qkv.size(0), d = qkv.size(2), kvh = (qkv.size(1) - heads) / 2;
  TORCH_CHECK(heads > 0 && kvh > 0 && heads + 2 * kvh == qkv.size(1) && d % 2 == 0,
              "rope_store: qkv's second dim must be heads + 2 * kv_heads");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == rows && t->size(1) == 1 && t->size(2) == d / 2 && t->stride(2) == 1,
                "rope_store: cos and sin must be [T, 1, d / 2] with unit last stride");
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rope_store: cos/sin dtype differs from qkv's");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows && slots.is_contiguous(),
              "rope_store: slots must be [T] contiguous int64");
  TORCH_CHECK(layer_kv.dim() == 5 && layer_kv.size(0) == 2 && layer_kv.is_contiguous() &&
                  layer_kv.size(3) == kvh && layer_kv.size(4) == d && layer_kv.scalar_type() == qkv.scalar_type(),
              "rope_store: layer_kv must be a contiguous [2, num_blocks, B, kv_heads, d] pool of qkv's dtype");
  switch (qkv.scalar_type()) {
    case at::kFloat: rope_store_rows<float>(qkv, cos, sin, slots, layer_kv, heads); break;
    case at::kBFloat16: rope_store_rows<c10::BFloat16>(qkv, cos, sin, slots, layer_kv, heads); break;
    case at::kHalf: rope_store_rows<c10::Half>(qkv, cos, sin, slots, layer_kv, heads); break;
    default: TORCH_CHECK(false, "rope_store: unsupported dtype ", qkv.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("silu_mul(Tensor gate_up, int intermediate) -> Tensor");
  m.def("rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(b!) layer_kv, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_store", &rope_store);
}
