// The layer's steps between its products: RMSNorm and LayerNorm, the LoRA adapters' products, the MLP's
// activation (SiLU, GELU) and the q/k head norms.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_kernel_common.h"
#include "float_products_cpu.h"

namespace {

void rms_normalize(const float* x, int64_t batch, int64_t h, float eps, const float* gain, float* y) {
  for (int64_t b = 0; b < batch; ++b) {
    const float* xb = x + b * h;
    float ss = 0.f;
    for (int64_t e = 0; e < h; ++e) ss += xb[e] * xb[e];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    for (int64_t e = 0; e < h; ++e) y[b * h + e] = xb[e] * inv * gain[e];
  }
}

// The layer's norm (iconfig[18]): RMSNorm (a gain) or LayerNorm (the mean subtracted, a gain and a bias: BERT)
enum Norm : int32_t { kRmsNorm = 0, kLayerNorm = 1 };

// One row of h: y = (x - mean) / sqrt(var + eps) * gain + bias, mean and variance summed in double (BERT's eps is
// 1e-12: the variance's rounding must not dominate it); y may be x
inline void layer_normalize_row(const float* x, int64_t h, float eps, const float* gain, const float* bias, float* y) {
  double sum = 0.0;
  for (int64_t e = 0; e < h; ++e) sum += x[e];
  const double mean = sum / static_cast<double>(h);
  double ss = 0.0;
  for (int64_t e = 0; e < h; ++e) ss += (x[e] - mean) * (x[e] - mean);
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(h) + static_cast<double>(eps));
  for (int64_t e = 0; e < h; ++e) y[e] = static_cast<float>((x[e] - mean) * inv) * gain[e] + bias[e];
}

// y[b] = norm(x[b]) * gain (+ bias: LayerNorm) for rows b of x (B, h): rms_normalize's bits for RMSNorm
void normalize(int32_t norm, const float* x, int64_t batch, int64_t h, float eps, const float* gain, const float* bias,
               float* y) {
  if (norm == kRmsNorm) {
    rms_normalize(x, batch, h, eps, gain, y);
    return;
  }
  for (int64_t b = 0; b < batch; ++b) layer_normalize_row(x + b * h, h, eps, gain, bias, y + b * h);
}

// One product's LoRA adapters, stacked by slot: A (S, parts*R, K) and B transposed, (S, R, N), the scale folded
// into B. Output row j belongs to part part_of(j) (q/k/v of the q/k/v product, gate/up of gate_up; one part for
// o and down), whose R-wide slice of u = A[slot] x it reads: out[j] += sum_k u[part][k] B[slot][k][j], summed
// across outputs (16 at a time) rather than along R. Slot 0 is the base model (no adapter): its rows are not
// touched, and a step whose rows are all slot 0 costs nothing more.
struct LoraProduct {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t slots = 0, parts = 1, r = 0, k = 0, n = 0;
  int64_t bound1 = 0, bound2 = 0;             // first output row of parts 1 and 2

  bool set(void* a_ptr, const int64_t* a_shape, void* b_ptr, const int64_t* b_shape, int64_t nparts, int64_t rows,
           int64_t cols, int64_t first1, int64_t first2) {
    a = static_cast<const float*>(a_ptr);
    b = static_cast<const float*>(b_ptr);
    slots = a_shape[0], parts = nparts, k = cols, n = rows, r = b_shape[1];
    bound1 = first1, bound2 = first2;
    return slots >= 1 && r >= 1 && a_shape[1] == parts * r && a_shape[2] == k && b_shape[0] == slots &&
           b_shape[2] == n;
  }
  int64_t part_of(int64_t j) const { return j < bound1 ? 0 : j < bound2 ? 1 : 2; }

  // u[row] (parts*R, at u + row * ldu) = A[slot] x[row] for rows[0..count) that all use `slot`: each tile of
  // A's rows is read once for all of them
  void project(int32_t slot, const int64_t* rows_of, int64_t count, const float* x, int64_t ldx, float* u,
               int64_t ldu) const {
    const int64_t w = parts * r;
    const float* ab = a + slot * w * k;
    for (int64_t i = 0; i < w; i += 4)
      for (int64_t at = 0; at < count; ++at)
        dot4(ab + i * k, std::min<int64_t>(4, w - i), x + rows_of[at] * ldx, u + rows_of[at] * ldu + i);
  }
  // y[row][j] += B[slot][j] . u[row][part(j)] for every output j of rows[0..count) (all using `slot`): each row
  // of B^T is read once for all of them, and the runs over j are long (vectorized)
  void add(int32_t slot, const int64_t* rows_of, int64_t count, const float* u, int64_t ldu, float* y,
           int64_t ldy) const {
    const float* bt = b + slot * r * n;
    const int64_t ends[3] = {bound1, bound2, n};
    for (int64_t part = 0, j0 = 0; part < parts; j0 = ends[part], ++part) {
      for (int64_t at = 0; at < count; ++at) {
        const float* ur = u + rows_of[at] * ldu + part * r;
        float* yr = y + rows_of[at] * ldy;
        int64_t j = j0;
        for (; j + 16 <= ends[part]; j += 16) {      // 16 outputs in a register across all R
          v16 acc = load16(yr + j);
          for (int64_t kk = 0; kk < r; ++kk) acc += ur[kk] * load16(bt + kk * n + j);
          std::memcpy(yr + j, &acc, sizeof(acc));
        }
        for (; j < ends[part]; ++j)
          for (int64_t kk = 0; kk < r; ++kk) yr[j] += ur[kk] * bt[kk * n + j];
      }
    }
  }
  // out[i] = A row i . x for the n (<= 4) rows of A from `rows` on: four accumulators, x read once
  void dot4(const float* rows, int64_t n, const float* x, float* out) const {
    v16 acc[4] = {};
    int64_t e = 0;
    for (; e + 16 <= k; e += 16) {
      const v16 xv = load16(x + e);
      for (int64_t i = 0; i < n; ++i) acc[i] += load16(rows + i * k + e) * xv;
    }
    for (int64_t i = 0; i < n; ++i) {
      float tail = 0.f;
      for (int64_t t = e; t < k; ++t) tail += rows[i * k + t] * x[t];
      out[i] = hsum(acc[i]) + tail;
    }
  }

};

// The MLP's activation (iconfig[12]): act = f(gate) * up (an ungated MLP: f(up), up = 1 here). kQuickGelu is a
// vision tower's alone (Qwen2-VL's fc1, vision_layer_cpu.cc's VisionLinear); the decoder layer refuses it.
enum Activation : int32_t { kSiLU = 0, kGeluTanh = 1, kGeluErf = 2, kQuickGelu = 3 };

// g * sigmoid(z) * u, with the exponential of a non-positive argument only
inline float sigmoid_times(float g, float z, float u) {
  const float e = llm_serving::exp_nonpositive(-std::fabs(z));     // e^-|z|
  const float sigmoid = z >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return g * sigmoid * u;
}

// silu(g) * u = g sigmoid(g) u
inline float silu_times(float g, float u) { return sigmoid_times(g, g, u); }

// gelu_tanh(g) * u: 0.5 g (1 + tanh(y)) = g sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3) (GELU's tanh
// approximation, Gemma's gelu_pytorch_tanh), as a sigmoid: no cancellation in 1 + tanh for negative g
inline float gelu_times(float g, float u) {
  return sigmoid_times(g, 1.5957691216057308f * (g + 0.044715f * g * g * g), u);
}

// gelu(g) * u with GELU's exact form, 0.5 g (1 + erf(g / sqrt(2))) (BERT's "gelu")
inline float gelu_erf_times(float g, float u) { return 0.5f * g * (1.f + std::erf(g * 0.7071067811865476f)) * u; }

// quick_gelu(g) * u = g sigmoid(1.702 g) u (transformers' "quick_gelu": CLIP's and Qwen2-VL's towers)
inline float quick_gelu_times(float g, float u) { return sigmoid_times(g, 1.702f * g, u); }

// f(g) * u for the activation f
inline float activation_times(int32_t activation, float g, float u) {
  switch (activation) {
    case kGeluTanh: return gelu_times(g, u);
    case kGeluErf: return gelu_erf_times(g, u);
    case kQuickGelu: return quick_gelu_times(g, u);
    default: return silu_times(g, u);
  }
}

// silu_times, gelu_times and gelu_erf_times of 8 values (not inlined: one compiled copy each)
__attribute__((noinline)) void silu8(const float* g, const float* u, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = silu_times(g[i], u[i]);
}
__attribute__((noinline)) void gelu8(const float* g, const float* u, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = gelu_times(g[i], u[i]);
}
__attribute__((noinline)) void gelu_erf8(const float* g, const float* u, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = gelu_erf_times(g[i], u[i]);
}
__attribute__((noinline)) void quick_gelu8(const float* g, const float* u, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = quick_gelu_times(g[i], u[i]);
}

// out[i] = f(g[i]) * u[i] for the activation f, i < n, 8 at a time through silu8 or gelu8 (the last ones
// padded): the same float for a value wherever it sits. Every MLP but the few-row fast path's takes it:
// silu_times inlined into a loop is vectorized there and its remainder not, and the two need not agree to the bit
// (batch-invariant steps would then differ between their few-row and many-row routes).
void activation_span(int32_t activation, const float* g, const float* u, int64_t n, float* out) {
  void (*const act8)(const float*, const float*, float*) = activation == kGeluTanh    ? gelu8
                                                            : activation == kGeluErf   ? gelu_erf8
                                                            : activation == kQuickGelu ? quick_gelu8
                                                                                       : silu8;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) act8(g + i, u + i, out + i);
  if (i < n) {
    float gp[8] = {}, up[8] = {}, op[8];
    std::memcpy(gp, g + i, (n - i) * sizeof(float));
    std::memcpy(up, u + i, (n - i) * sizeof(float));
    act8(gp, up, op);
    std::memcpy(out + i, op, (n - i) * sizeof(float));
  }
}

// act[b * ld + i] = f(gate[i][b]) * up[i][b] for i < n, b < bb, f GELU (tanh approximation or erf): the few-row MLP's
// GELU, out of line (inlined beside that loop's SiLU, it made GCC compile the SiLU models' few-row steps 4-8% slower)
__attribute__((noinline)) void gelu_block(int32_t activation, const float gate[4][4], const float up[4][4], int64_t n,
                                          int bb, float* act, int64_t ld) {
  for (int64_t i = 0; i < n; ++i)
    for (int b = 0; b < bb; ++b)
      act[b * ld + i] = activation == kGeluErf ? gelu_erf_times(gate[i][b], up[i][b]) : gelu_times(gate[i][b], up[i][b]);
}

// out[b] = res[b] + norm(y[b]) * gain (+ bias: LayerNorm) for rows b = first, first + step, ... < rows of (rows, h)
// (a sandwich norm on a product's result before the residual); out may be res
void add_normalized(int32_t norm, const float* y, const float* res, int64_t first, int64_t step, int64_t rows,
                    int64_t h, float eps, const float* gain, const float* bias, float* out, float* scratch) {
  for (int64_t b = first; b < rows; b += step) {
    const float* yb = y + b * h;
    if (norm == kLayerNorm) {
      layer_normalize_row(yb, h, eps, gain, bias, scratch);
      for (int64_t e = 0; e < h; ++e) out[b * h + e] = res[b * h + e] + scratch[e];
      continue;
    }
    float ss = 0.f;
    for (int64_t e = 0; e < h; ++e) ss += yb[e] * yb[e];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    for (int64_t e = 0; e < h; ++e) out[b * h + e] = res[b * h + e] + yb[e] * inv * gain[e];
  }
}

// x[b] = norm(x[b]) * gain (+ bias) in place for rows b = first, first + step, ... < rows of (rows, h): a post norm
// after the residual add (BERT: x = LayerNorm(x + attention), x = LayerNorm(x + mlp))
void normalize_in_place(int32_t norm, float* x, int64_t first, int64_t step, int64_t rows, int64_t h, float eps,
                        const float* gain, const float* bias) {
  for (int64_t b = first; b < rows; b += step) normalize(norm, x + b * h, 1, h, eps, gain, bias, x + b * h);
}

// v (n, d): each d-vector v / sqrt(mean(v^2) + eps) * gain, in place (Qwen3's and Gemma 3's q and k norms)
void normalize_heads(float* v, int64_t n, int64_t d, float eps, const float* gain) {
  for (int64_t i = 0; i < n; ++i) {
    float* vi = v + i * d;
    float ss = 0.f;
    for (int64_t e = 0; e < d; ++e) ss += vi[e] * vi[e];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t e = 0; e < d; ++e) vi[e] = vi[e] * inv * gain[e];
  }
}

}  // namespace
