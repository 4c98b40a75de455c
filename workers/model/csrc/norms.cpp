// RMSNorm on the CPU in one pass per row, and the residual add fused in front of it. torch's
// rms_norm runs as five or six ATen ops per call (pow, mean, add, rsqrt, two muls: ~40 us at
// decode sizes on the 2-core VM, most of it dispatch), twice a layer; this is one op.
//
// The arithmetic is transformers' (LlamaRMSNorm): in fp32, y = w * (x * rsqrt(mean(x^2) + eps));
// in bf16/fp16 x is widened, normalised in fp32 and rounded to the model dtype, then scaled by
// the weight in that dtype (one rounding after the product), as RMSNorm.forward does. The sum
// of squares is accumulated 16 lanes at a time, so it differs from torch's reduction by the
// order of the float sums only.
//
// Registered as torch.ops.pdserve_cpu.rms_norm / add_rms_norm (schemas below), in the same
// extension as paged_attention.cpp (cpu_kernels.py builds both).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

typedef float vf16n __attribute__((vector_size(64)));
typedef float vf8n __attribute__((vector_size(32)));
typedef float vf4n __attribute__((vector_size(16)));
constexpr int64_t kNormLanes = 16;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

inline float hsum16(vf16n v) {
  vf8n a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4n b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1];
}

// Sum of squares of n floats: 16 lanes, then the tail.
inline float sum_squares(const float* x, int64_t n) {
  vf16n acc{};
  int64_t i = 0;
  for (; i + kNormLanes <= n; i += kNormLanes) {
    vf16n v;
    std::memcpy(&v, x + i, sizeof(v));
    acc += v * v;
  }
  float s = hsum16(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// One row: (optionally x += delta, rounded to T and stored back), then y = norm(x) * w.
// buf: n floats of scratch (the row widened to fp32).
template <typename T, bool kAdd>
inline void norm_row(T* x, const T* delta, const T* w, T* y, int64_t n, float eps, float* buf) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (kAdd) {
      const T sum = from_float<T>(to_float(x[i]) + to_float(delta[i]));
      x[i] = sum;
      buf[i] = to_float(sum);
    } else {
      buf[i] = to_float(x[i]);
    }
  }
  const float rstd = 1.0f / std::sqrt(sum_squares(buf, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      y[i] = w[i] * (buf[i] * rstd);
    } else {  // round the normalised value to T, then the product with the weight
      y[i] = from_float<T>(to_float(w[i]) * to_float(from_float<T>(buf[i] * rstd)));
    }
  }
}

template <typename T, bool kAdd>
void norm_rows(at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, at::Tensor& y, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = kAdd ? delta->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t xs = x.stride(0), ds = kAdd ? delta->stride(0) : 0, ys = y.stride(0);
  // Rows in parallel only when there is enough work to pay for waking the other threads.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      norm_row<T, kAdd>(xp + r * xs, kAdd ? dp + r * ds : nullptr, wp, yp + r * ys, n,
                        static_cast<float>(eps), buf.data());
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [rows, n] with unit last stride");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), what, ": weight must be [n]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": x and weight dtypes differ");
}

template <bool kAdd>
at::Tensor dispatch(at::Tensor x, const at::Tensor* delta, const at::Tensor& w, double eps) {
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: norm_rows<float, kAdd>(x, delta, w, y, eps); break;
    case at::kBFloat16: norm_rows<c10::BFloat16, kAdd>(x, delta, w, y, eps); break;
    case at::kHalf: norm_rows<c10::Half, kAdd>(x, delta, w, y, eps); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  return dispatch<false>(x, nullptr, weight, eps);
}

// x += delta in place (the residual stream), then returns rms_norm(x).
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.stride(1) == 1 && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta must match x");
  return dispatch<true>(x, &delta, weight, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
