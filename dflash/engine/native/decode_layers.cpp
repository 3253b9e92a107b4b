// The decoder layers of a decode step or a verification block (few rows) in one C++ call.
//
// Why: a decode step of a small model is ~1000 small ATen calls, and from Python each costs a few
// microseconds of interpreter and argument parsing on top of the kernel. This file makes exactly
// the calls model.py makes, in the same order with the same shapes and dtypes, so its results are
// bit-identical to the Python path (tests/model/test_native.py) and only the overhead goes.
#include <torch/extension.h>

#include "step_pool.h"
#include "tree_chain.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

// quantized_linear.cpp
bool vnni_available();
bool amx_available();
bool int8dot_available();
std::string int8dot_isa(int64_t rows, bool int4);
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
void quantized_matmul_into(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const void* scales, int64_t N,
                           bool int4, at::BFloat16* y);
// causal_attention.cpp
bool causal_attention_available();
std::string causal_attention_isa();
std::vector<std::string> causal_attention_isas();
int64_t causal_attention_revision();
std::vector<std::string> chunk_softmax_isas();
std::vector<at::Tensor> softmax_rows(const at::Tensor& scores, const at::Tensor& seen, const std::string& isa);
void causal_attention_bf16_into(const at::BFloat16* q, int64_t T, int64_t H, int64_t D, const at::BFloat16* keys,
                                const at::BFloat16* values, int64_t KV, int64_t L, int64_t head_stride, int64_t start,
                                at::BFloat16* out);
void causal_attention_f32_into(const float* q, int64_t T, int64_t H, int64_t D, const float* keys, const float* values,
                               int64_t KV, int64_t L, int64_t head_stride, int64_t start, float* out);
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start);
template <typename T>
void tree_attention_into(const T* q, int64_t tokens, int64_t H, int64_t D, T* keys, T* values, int64_t KV, int64_t L,
                         int64_t head_stride, int64_t start, const std::vector<TreeChain>& chains, const T* new_keys,
                         int64_t key_stride, const T* new_values, int64_t value_stride, T* out);
template <typename T>
void tree_attention_int8_into(const T* q, int64_t tokens, int64_t H, int64_t D, uint8_t* keys, int8_t* values,
                              float* key_scales, float* value_scales, int64_t KV, int64_t L, int64_t head_stride,
                              int64_t scale_stride, int64_t start, const std::vector<TreeChain>& chains, const T* new_keys,
                              int64_t key_stride, const T* new_values, int64_t value_stride, T* out);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor widen_to_fp32(const at::Tensor& x);
bool int8_kv_available();
bool int8_kv_tiles(int64_t D);
int64_t int8_kv_revision();
void quantize_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor keys, at::Tensor values, at::Tensor key_scales,
                 at::Tensor value_scales, int64_t start);
at::Tensor causal_attention_int8(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales,
                                 const at::Tensor& value_scales, int64_t start);

namespace {

// torch's quantized kernels (kInt8, kInt4) or ours (kInt8Dot, kInt4Dot): quant.py's layouts.
enum LinearKind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2, kInt8Dot = 3, kInt4Dot = 4 };

struct Linear {
  int64_t kind;
  at::Tensor a, b, bias;  // dense: weight, -, bias | int8: qweight, scales, bias | int4: packed, scales_and_zeros, bias
  bool has_bias;
  int64_t out_features;
  int64_t group;

  at::Tensor operator()(const at::Tensor& x) const {  // model.Linear / quant.QuantizedLinear, few rows
    if (kind == kDense) return at::linear(x, a, has_bias ? c10::optional<at::Tensor>(bias) : c10::nullopt);
    auto flat = x.reshape({-1, x.size(-1)});
    auto input = flat.to(at::kBFloat16);
    at::Tensor out;
    switch (kind) {
      case kInt8: out = at::_weight_int8pack_mm(input, a, b); break;
      case kInt4: out = at::_weight_int4pack_mm_for_cpu(input, a, group, b); break;
      case kInt8Dot: out = int8_matmul(input, a, b); break;
      default: out = int4_matmul(input, a, b); break;
    }
    out = out.to(x.scalar_type());
    if (has_bias) out = out + bias.to(x.scalar_type());
    auto shape = x.sizes().vec();
    shape.back() = out_features;
    return out.view(shape);
  }
};

// ---- a draft tree's verification (speculative.py, DraftTree) ---------------------------------
//
// Rows in depth-first order: row 0 the pending token, parents[t] the row before t on its path
// (-1 for row 0), each row at position start + its depth. A chain is a run of rows each the child
// of the one before. Each chain is attended as the causal rows it is: the keys of its path (the
// rows at depths 0.. before it, then its own) go to positions start.., and the causal kernel runs
// its rows from start + the depth of its first row. So every row sees exactly the keys, at the same
// positions and in the same order, as a decode step of its path would, and gets the same bits
// (the kernels compute a row the same way whatever other rows a call holds). Chains are attended
// last first: chain 0, the drafter's first choices, is written last and stays in the cache. All of
// a layer's chains are one call (causal_attention.cpp, attend_tree), which computes the partials of
// the chunks of keys below the tree once for them all.
std::vector<TreeChain> tree_chains(const std::vector<int64_t>& parents, int64_t T) {
  TORCH_CHECK(int64_t(parents.size()) == T && T > 0 && parents[0] == -1,
              "decode_layers: tree parents must give one parent a row, -1 for row 0; got ", parents.size(), " for ", T, " rows");
  std::vector<int64_t> depth(T, 0);
  for (int64_t t = 1; t < T; ++t) {
    TORCH_CHECK(parents[t] >= 0 && parents[t] < t, "decode_layers: row ", t, "'s parent ", parents[t], " is not a row before it");
    depth[t] = depth[parents[t]] + 1;
  }
  std::vector<TreeChain> chains;
  for (int64_t t = 0; t < T; ++t) {
    if (t > 0 && parents[t] == t - 1) {
      chains.back().end = t + 1;
      chains.back().path.push_back(t);
      continue;
    }
    TreeChain chain{t, t + 1, depth[t], {}};
    for (int64_t a = t > 0 ? parents[t] : -1; a >= 0; a = parents[a]) chain.path.push_back(a);
    std::reverse(chain.path.begin(), chain.path.end());
    chain.path.push_back(t);
    chains.push_back(chain);
  }
  std::reverse(chains.begin(), chains.end());
  return chains;
}

// ---- bf16 rows on 8 lanes (AVX2) -------------------------------------------------------------
//
// The elementwise steps of a layer (norms, rope, residual adds, SiLU's product) on bf16 rows, 8
// values at a time: each value takes the scalar code's exact operations (an fp32 product or sum,
// rounded to bf16 to nearest even, NaN to 0x7FC0 as c10::BFloat16 does), so the same bits. "avx2"
// without "fma": gcc may not fuse a product and a sum that the scalar code rounds apart. Scalar,
// they held up a verification's other thread for a fifth of the step (perf, 8 rows, 2 threads).
#define BF16_LANES_TARGET __attribute__((target("avx2")))

bool bf16_lanes_available() {
  static const bool available = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("avx2"));
  }();
  return available;
}

BF16_LANES_TARGET inline __m256 load_bf16x8(const at::BFloat16* p) {  // exact: bf16 is fp32's top half
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

BF16_LANES_TARGET inline __m256i bf16_bits(__m256 v) {  // c10::BFloat16(float)'s bits, one per 32-bit lane
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

BF16_LANES_TARGET inline __m256 round_bf16(__m256 v) {  // float(bf16(v))
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}

BF16_LANES_TARGET inline void store_bf16x8(at::BFloat16* out, __m256 v) {
  const __m256i bits = bf16_bits(v);  // 0..0xFFFF: packus saturates nothing
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// rms_norm_rows for bf16: partial[i] (the sums of squares over c = i mod 8) is lane i.
BF16_LANES_TARGET void rms_norm_bf16_lanes(const at::BFloat16* x, const at::BFloat16* weight, at::BFloat16* out, int64_t rows,
                                           int64_t C, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* in = x + r * C;
    __m256 lanes = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
      const __m256 v = load_bf16x8(in + c);
      lanes = _mm256_add_ps(lanes, _mm256_mul_ps(v, v));
    }
    alignas(32) float partial[8];
    _mm256_store_ps(partial, lanes);
    for (; c < C; ++c) partial[c % 8] += float(in[c]) * float(in[c]);
    float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
    const float inverse = 1.0f / std::sqrt(sum / float(C) + eps);
    at::BFloat16* o = out + r * C;
    for (c = 0; c + 8 <= C; c += 8) {
      const __m256 normed = round_bf16(_mm256_mul_ps(load_bf16x8(in + c), _mm256_set1_ps(inverse)));
      store_bf16x8(o + c, _mm256_mul_ps(load_bf16x8(weight + c), normed));
    }
    for (; c < C; ++c) o[c] = at::BFloat16(float(weight[c]) * float(at::BFloat16(float(in[c]) * inverse)));
  }
}

// rope_row for bf16 (D a multiple of 16, so each 8 values sit in one half of the row).
BF16_LANES_TARGET void rope_bf16_lanes(const at::BFloat16* xr, const at::BFloat16* ct, const at::BFloat16* st, at::BFloat16* orow,
                                       int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 rotated = load_bf16x8(xr + (d < half ? d + half : d - half));
    const __m256 a = round_bf16(_mm256_mul_ps(load_bf16x8(xr + d), load_bf16x8(ct + d)));
    const __m256 b = round_bf16(_mm256_mul_ps(rotated, load_bf16x8(st + d)));
    store_bf16x8(orow + d, _mm256_add_ps(a, b));
  }
}

// out = bf16(float(a) op float(b)) over n values (torch's bf16 add and mul).
template <bool kProduct>
BF16_LANES_TARGET void combine_bf16_lanes(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load_bf16x8(a + i), y = load_bf16x8(b + i);
    store_bf16x8(out + i, kProduct ? _mm256_mul_ps(x, y) : _mm256_add_ps(x, y));
  }
  for (; i < n; ++i) out[i] = at::BFloat16(kProduct ? float(a[i]) * float(b[i]) : float(a[i]) + float(b[i]));
}

// ---- SiLU's product: act = bf16(bf16(silu(gate)) * up), the rounding steps of torch's bf16 ops ----
//
// Why: at::silu on a verification's 8 rows cost ~12 us a layer (0.37 ms of a 6.6 ms 1+7-row step on
// Zen 4, 2 threads; ~4 us for one row), its own dispatch and a copy included. Here one pass per row
// (the same function for prefill, model.FeedForward, and every decode path, so rows stay equal):
// silu(x) = x / (1 + t) for x >= 0 and x * t / (1 + t) below, t = exp(-|x|), so exp only meets
// arguments <= 0 (never overflows). On AVX2 + FMA 8 lanes with one polynomial; elsewhere std::exp
// (other bits, but every path of that machine computes them).
#define SILU_TARGET __attribute__((target("avx2,fma")))

bool silu_lanes_available() {
  static const bool available = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return available;
}

// exp(x) for x <= 0: Cephes' range reduction and degree-5 polynomial (as causal_attention.cpp's).
SILU_TARGET inline __m256 exp_of_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38: silu is ~0 there either way
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// silu over kWay vectors side by side: one vector's ~90-cycle chain of dependent steps filled the FP
// scheduler, so vectors did not overlap (1.2 ns a value on Zen 4 on 8 lanes; 0.7 on 16).
constexpr int kWay = 4;
#define UNROLLED_SILU _Pragma("GCC unroll 4")

SILU_TARGET inline void silu_lanes(__m256* v) {
  __m256 t[kWay];
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) t[k] = exp_of_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[k])));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) {
    const __m256 numerator = _mm256_blendv_ps(v[k], _mm256_mul_ps(v[k], t[k]), _mm256_cmp_ps(v[k], _mm256_setzero_ps(), _CMP_LT_OQ));
    v[k] = _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), t[k]));  // NaN stays NaN
  }
}

inline float silu_scalar(float x) {
  const float t = std::exp(-std::fabs(x));
  return (x < 0.0f ? x * t : x) / (1.0f + t);
}

// Rows of gate_up [rows, 2I] (gate, then up) -> act [rows, I].
SILU_TARGET void silu_product_lanes(const at::BFloat16* gate_up, int64_t rows, int64_t I, at::BFloat16* act) {
  constexpr int64_t kStep = 8 * kWay;
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16 *gate = gate_up + r * 2 * I, *up = gate + I;
    at::BFloat16* out = act + r * I;
    // One copy of the loop's body for every value (a tail runs it on padded copies): gcc may fuse
    // a product and a sum differently in two inlined copies.
    for (int64_t i = 0; i < I; i += kStep) {
      const int64_t n = std::min<int64_t>(kStep, I - i);
      at::BFloat16 padded[3][kStep];
      const at::BFloat16 *g = gate + i, *u = up + i;
      at::BFloat16* o = out + i;
      if (n < kStep) {
        std::fill(&padded[0][0], &padded[0][0] + 3 * kStep, at::BFloat16(0.0f));
        std::copy(g, g + n, padded[0]);
        std::copy(u, u + n, padded[1]);
        g = padded[0], u = padded[1], o = padded[2];
      }
      __m256 v[kWay];
      UNROLLED_SILU for (int k = 0; k < kWay; ++k) v[k] = load_bf16x8(g + 8 * k);
      silu_lanes(v);
      UNROLLED_SILU for (int k = 0; k < kWay; ++k) store_bf16x8(o + 8 * k, _mm256_mul_ps(round_bf16(v[k]), load_bf16x8(u + 8 * k)));
      if (n < kStep) std::copy(padded[2], padded[2] + n, out + i);
    }
  }
}

// The same operations on 16 lanes (AVX512F): each lane's value is computed by the same IEEE
// operations in the same order as above, so the same bits at half the instructions.
#define SILU512_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw")))

bool silu_16_lanes_available() {
  static const bool available = [] {
    __builtin_cpu_init();
    return silu_lanes_available() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return available;
}

SILU512_TARGET inline void silu_16_lanes(__m512* v) {
  __m512 x[kWay], fx[kWay], y[kWay], t[kWay];
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) x[k] = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v[k])), _mm512_set1_ps(-87.0f));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k)
    fx[k] = _mm512_roundscale_ps(_mm512_fmadd_ps(x[k], _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                 _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) x[k] = _mm512_fnmadd_ps(fx[k], _mm512_set1_ps(0.693359375f), x[k]);
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) x[k] = _mm512_fnmadd_ps(fx[k], _mm512_set1_ps(-2.12194440e-4f), x[k]);
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) y[k] = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), x[k], _mm512_set1_ps(1.3981999507e-3f));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) y[k] = _mm512_fmadd_ps(y[k], x[k], _mm512_set1_ps(8.3334519073e-3f));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) y[k] = _mm512_fmadd_ps(y[k], x[k], _mm512_set1_ps(4.1665795894e-2f));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) y[k] = _mm512_fmadd_ps(y[k], x[k], _mm512_set1_ps(1.6666665459e-1f));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) y[k] = _mm512_fmadd_ps(y[k], x[k], _mm512_set1_ps(5.0000001201e-1f));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) y[k] = _mm512_fmadd_ps(y[k], _mm512_mul_ps(x[k], x[k]), _mm512_add_ps(x[k], _mm512_set1_ps(1.0f)));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k)
    t[k] = _mm512_mul_ps(y[k], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx[k]), _mm512_set1_epi32(127)), 23)));
  UNROLLED_SILU for (int k = 0; k < kWay; ++k) {
    const __m512 numerator = _mm512_mask_mul_ps(v[k], _mm512_cmp_ps_mask(v[k], _mm512_setzero_ps(), _CMP_LT_OQ), v[k], t[k]);
    v[k] = _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), t[k]));
  }
}

SILU512_TARGET inline __m512 load_bf16x16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

SILU512_TARGET inline __m512i bf16_bits16(__m512 v) {  // bf16_bits on 16 lanes
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

SILU512_TARGET void silu_product_16_lanes(const at::BFloat16* gate_up, int64_t rows, int64_t I, at::BFloat16* act) {
  constexpr int64_t kStep = 16 * kWay;
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16 *gate = gate_up + r * 2 * I, *up = gate + I;
    at::BFloat16* out = act + r * I;
    for (int64_t i = 0; i < I; i += kStep) {  // one copy of the body, as silu_product_lanes
      const int64_t n = std::min<int64_t>(kStep, I - i);
      at::BFloat16 padded[3][kStep];
      const at::BFloat16 *g = gate + i, *u = up + i;
      at::BFloat16* o = out + i;
      if (n < kStep) {
        std::fill(&padded[0][0], &padded[0][0] + 3 * kStep, at::BFloat16(0.0f));
        std::copy(g, g + n, padded[0]);
        std::copy(u, u + n, padded[1]);
        g = padded[0], u = padded[1], o = padded[2];
      }
      __m512 v[kWay];
      UNROLLED_SILU for (int k = 0; k < kWay; ++k) v[k] = load_bf16x16(g + 16 * k);
      silu_16_lanes(v);
      UNROLLED_SILU for (int k = 0; k < kWay; ++k) {
        const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v[k]), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * k), _mm512_cvtepi32_epi16(bf16_bits16(_mm512_mul_ps(silu, load_bf16x16(u + 16 * k)))));
      }
      if (n < kStep) std::copy(padded[2], padded[2] + n, out + i);
    }
  }
}

void silu_product_rows(const at::BFloat16* gate_up, int64_t rows, int64_t I, at::BFloat16* act) {
  if (silu_lanes_available()) {
    // rows over the step's threads (a verification's 8 rows of 1536: ~13 us on one, Zen 4)
    const bool wide = silu_16_lanes_available() && std::getenv("DFLASH_SILU_LANES") == nullptr;  // =8: tests compare
    return step_pool::parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
      if (wide) silu_product_16_lanes(gate_up + begin * 2 * I, end - begin, I, act + begin * I);
      else silu_product_lanes(gate_up + begin * 2 * I, end - begin, I, act + begin * I);
    }, rows * I >= 8192);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i)
      act[r * I + i] = at::BFloat16(float(at::BFloat16(silu_scalar(float(gate_up[r * 2 * I + i])))) * float(gate_up[r * 2 * I + I + i]));
}

// model.FeedForward's silu(gate) * up for bf16 rows: gate_up [..., 2I] -> [..., I].
at::Tensor silu_product(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_product: expected bf16 [..., 2I], got ", gate_up.scalar_type(), " ", gate_up.sizes());
  const auto input = gate_up.contiguous();
  const int64_t I = input.size(-1) / 2, rows = I == 0 ? 0 : input.numel() / (2 * I);
  auto sizes = input.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, input.options());
  silu_product_rows(input.data_ptr<at::BFloat16>(), rows, I, out.data_ptr<at::BFloat16>());
  return out;
}

// model.RMSNorm over the last dimension, row by row in one fixed order (so a row's result does not
// depend on the other rows): normed = dtype(x * 1/sqrt(mean(x^2) + eps)) in fp32, out = dtype(weight * normed).
// torch's rms_norm costs ~30 us per call here (it runs as a chain of ops), a decode step makes 61.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t C, float eps) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (bf16_lanes_available()) return rms_norm_bf16_lanes(x, weight, out, rows, C, eps);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * C;
    float partial[8] = {};
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
      for (int i = 0; i < 8; ++i) partial[i] += float(in[c + i]) * float(in[c + i]);
    }
    for (; c < C; ++c) partial[c % 8] += float(in[c]) * float(in[c]);
    float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
    const float inverse = 1.0f / std::sqrt(sum / float(C) + eps);
    T* o = out + r * C;
    for (c = 0; c < C; ++c) o[c] = T(float(weight[c]) * float(T(float(in[c]) * inverse)));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.size(-1) == weight.numel(),
              "rms_norm: x ", x.sizes(), " ", x.scalar_type(), " and weight ", weight.sizes(), " ", weight.scalar_type());
  auto input = x.contiguous(), w = weight.contiguous();
  auto out = at::empty_like(input);
  const int64_t C = input.size(-1), rows = input.numel() / C;
  if (input.scalar_type() == at::kBFloat16) {
    rms_norm_rows(input.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, C, float(eps));
  } else if (input.scalar_type() == at::kFloat) {
    rms_norm_rows(input.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, C, float(eps));
  } else {
    TORCH_CHECK(false, "rms_norm: unsupported dtype ", input.scalar_type());
  }
  return out;
}

// model.apply_rope, x * cos + roll(x, D/2) * sin, in one pass instead of four ATen calls (each
// ~4 us here, 30-60 a step): each product and the sum rounded to x's dtype, as torch's eager ops
// round them (bf16: computed in fp32, rounded to nearest even), so the same bits.
template <typename T>
void rope_row(const T* xr, const T* ct, const T* st, T* orow, int64_t D) {  // one head's row of D
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (D % 16 == 0 && bf16_lanes_available()) return rope_bf16_lanes(xr, ct, st, orow, D);
  }
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const T rotated = xr[d < half ? d + half : d - half];
    orow[d] = T(float(T(float(xr[d]) * float(ct[d]))) + float(T(float(rotated) * float(st[d]))));
  }
}

template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2);
  const T* in = x.data_ptr<T>();
  const T *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      rope_row(in + t * x.stride(0) + h * x.stride(1), c + t * cos.stride(0), s + t * sin.stride(0), o + (t * heads + h) * D, D);
    }
  }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {  // model.apply_rope
  const auto dtype = x.scalar_type();
  const bool fused = x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && cos.scalar_type() == dtype &&
                     sin.scalar_type() == dtype && cos.dim() == 3 && cos.size(1) == 1 && cos.size(2) == x.size(2) &&
                     cos.stride(2) == 1 && sin.sizes() == cos.sizes() && sin.strides() == cos.strides() &&
                     cos.size(0) == x.size(0) && (dtype == at::kBFloat16 || dtype == at::kFloat);
  if (!fused) return x * cos + at::roll(x, {x.size(-1) / 2}, {-1}) * sin;
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (dtype == at::kBFloat16) rope_rows<at::BFloat16>(x, cos, sin, out);
  else rope_rows<float>(x, cos, sin, out);
  return out;
}

at::Tensor grouped_query_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                   const at::Tensor& mask) {  // model.grouped_query_attention, mask already repeated
  auto T = q.size(0), H = q.size(1), D = q.size(2), KV = keys.size(0), G = H / KV;
  auto rows = q.view({T, KV, G, D}).permute({1, 2, 0, 3}).reshape({KV, G * T, D});
  auto out = at::scaled_dot_product_attention(rows.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask);
  return out.select(0, 0).view({KV, G, T, D}).permute({2, 0, 1, 3});
}

int64_t layers_without_aten_calls = 0;  // how many calls took layers_without_aten (tests read it)

// out = a + b over n bf16 values, as torch's bf16 add computes it: in fp32, rounded to nearest even.
void add_rows(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* out, int64_t n) {
  if (bf16_lanes_available()) return combine_bf16_lanes<false>(a, b, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = at::BFloat16(float(a[i]) + float(b[i]));
}

// out = a * b over n bf16 values, as torch's bf16 mul.
void multiply_rows(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* out, int64_t n) {
  if (bf16_lanes_available()) return combine_bf16_lanes<true>(a, b, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = at::BFloat16(float(a[i]) * float(b[i]));
}

// A thread's scratch rows, grown and never shrunk (one decode or verification at a time per thread).
at::BFloat16* scratch_rows(int64_t count) {
  thread_local std::vector<at::BFloat16> buffer;
  if (int64_t(buffer.size()) < count) buffer.resize(size_t(count));
  return buffer.data();
}

// decode_layers where every linear is one of our int8/int4 kernels, the cache is bf16 and attended by
// causal_attention.cpp, and x is bf16: the same kernels and the same roundings in the same order as the
// loop below, on raw rows, without its ~45 ATen calls a layer (views, copies, adds, allocations: 2-5 us
// each, a fifth of a decode step of the embedded model). Returns nothing where it does not apply; the loop then runs.
std::optional<std::vector<at::Tensor>> layers_without_aten(
    const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& key_scales, const at::Tensor& value_scales, int64_t start, const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& qk_norms,
    const std::vector<at::Tensor>& linear_tensors, const std::vector<int64_t>& kinds, const std::vector<int64_t>& has_bias,
    const std::vector<int64_t>& out_features, int64_t H, int64_t KV, int64_t D, int64_t intermediate, double eps,
    const std::vector<int64_t>& capture, const at::Tensor& capture_into, const std::vector<int64_t>& capture_columns,
    const std::vector<TreeChain>& chains, const at::Tensor& saved_keys, const at::Tensor& saved_values) {
  using bf16 = at::BFloat16;
  const auto kBf16 = at::kBFloat16;
  const int64_t layers = keys.size(0), T = x_in.size(0), C = x_in.size(1), L = keys.size(2), I = intermediate;
  const bool qk_norm = !qk_norms.empty(), int8_cache = key_scales.numel() > 0;
  if (std::getenv("DFLASH_LAYERS_WITHOUT_ATEN") != nullptr && std::string(std::getenv("DFLASH_LAYERS_WITHOUT_ATEN")) == "0") return std::nullopt;
  const bool cache_types = int8_cache ? keys.scalar_type() == at::kByte && values.scalar_type() == at::kChar
                                     : keys.scalar_type() == kBf16 && values.scalar_type() == kBf16;
  const bool scales_alike = !int8_cache || (key_scales.dim() == 3 && key_scales.stride(2) == 1 &&
                                            value_scales.strides() == key_scales.strides());
  if (x_in.dim() != 2 || x_in.scalar_type() != kBf16 || !cache_types || !scales_alike ||
      keys.dim() != 4 || keys.size(3) != D || keys.stride(3) != 1 || keys.stride(2) != D || values.strides() != keys.strides() ||
      values.sizes() != keys.sizes() || cos.scalar_type() != kBf16 || sin.scalar_type() != kBf16 || cos.dim() != 3 ||
      cos.size(0) != T || cos.size(2) != D || cos.stride(2) != 1 || sin.sizes() != cos.sizes() || sin.strides() != cos.strides() ||
      D % 2 != 0 || !(D == 16 || D == 32 || D == 64 || D == 128 || D == 256) || H % KV != 0 || start + T > L)
    return std::nullopt;
  const int64_t in_features[4] = {C, H * D, C, I}, outputs[4] = {(H + 2 * KV) * D, C, 2 * I, C};
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int which = 0; which < 4; ++which) {
      const int64_t i = layer * 4 + which;
      const auto &codes = linear_tensors[3 * i], &scales = linear_tensors[3 * i + 1], &bias = linear_tensors[3 * i + 2];
      const bool int4 = kinds[i] == kInt4Dot;
      if ((kinds[i] != kInt4Dot && kinds[i] != kInt8Dot) || out_features[i] != outputs[which] || codes.dim() != 4 ||
          !codes.is_contiguous() || !scales.is_contiguous() || codes.size(0) * 16 != outputs[which] ||
          codes.size(1) * 32 != in_features[which] || codes.size(2) * codes.size(3) != (int4 ? 256 : 512) ||
          scales.scalar_type() != (int4 ? kBf16 : at::kFloat) ||
          (has_bias[i] && (bias.scalar_type() != kBf16 || bias.numel() != outputs[which] || !bias.is_contiguous())))
        return std::nullopt;
    }
    for (int n = 0; n < 2; ++n)
      if (norms[2 * layer + n].scalar_type() != kBf16 || norms[2 * layer + n].numel() != C || !norms[2 * layer + n].is_contiguous()) return std::nullopt;
    for (int n = 0; n < 2 && qk_norm; ++n)
      if (qk_norms[2 * layer + n].scalar_type() != kBf16 || qk_norms[2 * layer + n].numel() != D || !qk_norms[2 * layer + n].is_contiguous())
        return std::nullopt;
  }

  auto x_out = x_in.contiguous().clone();
  bf16* x = x_out.data_ptr<bf16>();
  const int64_t QKV = (H + 2 * KV) * D;
  bf16* h = scratch_rows(T * (C + QKV + (H + KV) * D + H * D + C + 2 * I + I));
  bf16* qkv = h + T * C;
  bf16* q = qkv + T * QKV;  // [T, H, D], then k [T, KV, D]
  bf16* k = q + T * H * D;
  bf16* attended = k + T * KV * D;
  bf16* projected = attended + T * H * D;
  bf16* gate_up = projected + T * C;
  bf16* act = gate_up + T * 2 * I;
  const bf16 *cos_rows = cos.data_ptr<bf16>(), *sin_rows = sin.data_ptr<bf16>();
  const int64_t rope_stride = cos.stride(0);
  bf16* key_base = int8_cache ? nullptr : keys.data_ptr<bf16>();
  bf16* value_base = int8_cache ? nullptr : values.data_ptr<bf16>();
  const float epsilon = float(eps);
  std::vector<at::Tensor> captured;
  size_t next_capture = 0;
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto linear = [&](int which, const bf16* in, int64_t rows, bf16* out) {
      const int64_t i = layer * 4 + which;
      const bool int4 = kinds[i] == kInt4Dot;
      const auto& scales = linear_tensors[3 * i + 1];
      quantized_matmul_into(in, rows, in_features[which], linear_tensors[3 * i].data_ptr<uint8_t>(),
                            int4 ? static_cast<const void*>(scales.data_ptr<bf16>()) : scales.data_ptr<float>(),
                            outputs[which], int4, out);
      if (has_bias[i]) {
        const bf16* bias = linear_tensors[3 * i + 2].data_ptr<bf16>();
        for (int64_t t = 0; t < rows; ++t) add_rows(out + t * outputs[which], bias, out + t * outputs[which], outputs[which]);
      }
    };
    // attention
    rms_norm_rows(x, norms[2 * layer].data_ptr<bf16>(), h, T, C, epsilon);
    linear(0, h, T, qkv);
    for (int64_t t = 0; t < T; ++t) {
      const bf16* row = qkv + t * QKV;
      const bf16 *ct = cos_rows + t * rope_stride, *st = sin_rows + t * rope_stride;
      if (qk_norm) {  // model.py: rope(q_norm(q)), rope(k_norm(k)), each head's row normed on its own
        bf16 normed[256];
        for (int64_t head = 0; head < H + KV; ++head) {
          const bool is_query = head < H;
          rms_norm_rows(row + head * D, qk_norms[2 * layer + (is_query ? 0 : 1)].data_ptr<bf16>(), normed, 1, D, epsilon);
          rope_row(normed, ct, st, is_query ? q + (t * H + head) * D : k + (t * KV + head - H) * D, D);
        }
      } else {
        for (int64_t head = 0; head < H; ++head) rope_row(row + head * D, ct, st, q + (t * H + head) * D, D);
        for (int64_t head = 0; head < KV; ++head) rope_row(row + (H + head) * D, ct, st, k + (t * KV + head) * D, D);
      }
      if (saved_keys.defined()) {  // a tree's rows: kept for the path the verification accepts
        std::memcpy(saved_keys.data_ptr<bf16>() + (layer * T + t) * KV * D, k + t * KV * D, sizeof(bf16) * KV * D);
        std::memcpy(saved_values.data_ptr<bf16>() + (layer * T + t) * KV * D, row + (H + KV) * D, sizeof(bf16) * KV * D);
      }
      for (int64_t head = 0; head < KV && !int8_cache && chains.empty(); ++head) {  // this token's key and value into the cache
        const int64_t at = layer * keys.stride(0) + head * keys.stride(1) + (start + t) * D;
        std::memcpy(key_base + at, k + (t * KV + head) * D, sizeof(bf16) * D);
        std::memcpy(value_base + at, row + (H + KV + head) * D, sizeof(bf16) * D);
      }
    }
    if (!chains.empty() && int8_cache) {  // a draft tree over an int8 cache: all its chains in one call
      tree_attention_int8_into(q, T, H, D, keys.data_ptr<uint8_t>() + layer * keys.stride(0),
                               values.data_ptr<int8_t>() + layer * values.stride(0),
                               key_scales.data_ptr<float>() + layer * key_scales.stride(0),
                               value_scales.data_ptr<float>() + layer * value_scales.stride(0), KV, L, keys.stride(1),
                               key_scales.stride(1), start, chains, k, KV * D, qkv + (H + KV) * D, QKV, attended);
    } else if (!chains.empty()) {  // a draft tree over a bf16 cache: all its chains in one call
      tree_attention_into(q, T, H, D, key_base + layer * keys.stride(0), value_base + layer * keys.stride(0), KV, L,
                          keys.stride(1), start, chains, k, KV * D, qkv + (H + KV) * D, QKV, attended);
    } else if (int8_cache) {  // kv.Int8KVCache: the loop below's calls, on views of the rows
      const auto options = at::TensorOptions().dtype(kBf16);
      const auto layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);
      const auto layer_key_scales = key_scales.select(0, layer), layer_value_scales = value_scales.select(0, layer);
      quantize_kv(at::from_blob(k, {T, KV, D}, options), at::from_blob(qkv + (H + KV) * D, {T, KV, D}, {QKV, D, 1}, options),
                  layer_keys, layer_values, layer_key_scales, layer_value_scales, start);
      const auto out = causal_attention_int8(at::from_blob(q, {T, H, D}, options), layer_keys, layer_values, layer_key_scales,
                                             layer_value_scales, start);
      std::memcpy(attended, out.data_ptr<bf16>(), sizeof(bf16) * T * H * D);
    } else {
      causal_attention_bf16_into(q, T, H, D, key_base + layer * keys.stride(0), value_base + layer * keys.stride(0), KV, L,
                                 keys.stride(1), start, attended);
    }
    linear(1, attended, T, projected);
    add_rows(x, projected, x, T * C);
    // feed-forward
    rms_norm_rows(x, norms[2 * layer + 1].data_ptr<bf16>(), h, T, C, epsilon);
    linear(2, h, T, gate_up);
    silu_product_rows(gate_up, T, I, act);
    linear(3, act, T, projected);
    add_rows(x, projected, x, T * C);
    if (next_capture < capture.size() && capture[next_capture] == layer) {
      if (capture_into.defined()) {  // rows [T, C] into their columns of the drafter's rows
        bf16* into = capture_into.data_ptr<bf16>() + capture_columns[next_capture];
        for (int64_t t = 0; t < T; ++t) std::memcpy(into + t * capture_into.stride(0), x + t * C, sizeof(bf16) * C);
      } else {
        captured.push_back(x_out.clone());
      }
      ++next_capture;
    }
  }
  captured.insert(captured.begin(), x_out);
  ++layers_without_aten_calls;
  return captured;
}

}  // namespace

// x [T, C]; per layer: norms 2 (attention, ffn), qk_norms 2 or 0, linears 4 (wqkv, wo, w13, w2) x 3
// tensors with kinds/has_bias/out_features. Attention: causal_attention.cpp's (our_attention), else
// torch's over groups: row ranges of the new tokens with their padded key counts and repeated masks
// (model.attention_row_groups). An int8 cache (kv.Int8KVCache: key_scales and value_scales not empty)
// is written by quantize_kv and read by causal_attention_int8. Returns x after the last layer and the
// hidden states after each layer in `capture` (ascending).
std::vector<at::Tensor> decode_layers(
    at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& key_scales, const at::Tensor& value_scales, int64_t start, const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& qk_norms,
    const std::vector<at::Tensor>& linear_tensors, const std::vector<int64_t>& kinds,
    const std::vector<int64_t>& has_bias, const std::vector<int64_t>& out_features, int64_t group_size,
    const std::vector<int64_t>& group_starts, const std::vector<int64_t>& group_ends,
    const std::vector<int64_t>& group_keys, const std::vector<at::Tensor>& group_masks, bool our_attention, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, const std::vector<int64_t>& capture,
    const std::optional<at::Tensor>& capture_into_arg, const std::vector<int64_t>& capture_columns,
    const std::vector<int64_t>& tree_parents, const std::optional<at::Tensor>& saved_keys_arg,
    const std::optional<at::Tensor>& saved_values_arg) {
  at::NoGradGuard no_grad;
  // capture_into: [T, K * C] bf16 rows, row stride free, column `capture_columns[i]` for capture[i]:
  // the captured states are written there (the DFlash drafter's rows) instead of returned.
  const at::Tensor capture_into = capture_into_arg.has_value() ? *capture_into_arg : at::Tensor();
  if (capture_into.defined()) {
    TORCH_CHECK(capture_into.scalar_type() == at::kBFloat16 && capture_into.dim() == 2 && capture_into.stride(1) == 1 &&
                    capture_into.size(0) == x.size(0) && capture_columns.size() == capture.size(),
                "decode_layers: capture_into must be [T, K * C] bf16 rows with one column per captured layer, got ",
                capture_into.sizes(), " ", capture_into.scalar_type(), " for ", capture.size(), " layers");
    for (int64_t column : capture_columns)
      TORCH_CHECK(column >= 0 && column + x.size(1) <= capture_into.size(1), "decode_layers: capture column ", column,
                  " outside rows of ", capture_into.size(1));
  }
  const int64_t layers = keys.size(0), T = x.size(0), H = num_heads, KV = num_kv_heads, D = head_dim;
  const bool qk_norm = !qk_norms.empty(), int8_cache = key_scales.numel() > 0;
  // A draft tree (tree_chains): its rows' keys and values go to saved_keys/saved_values [layers, T,
  // KV, D] (x's dtype), from which the caller writes the accepted path's into the cache.
  const std::vector<TreeChain> chains = tree_parents.empty() ? std::vector<TreeChain>{} : tree_chains(tree_parents, T);
  const at::Tensor saved_keys = saved_keys_arg.has_value() ? *saved_keys_arg : at::Tensor();
  const at::Tensor saved_values = saved_values_arg.has_value() ? *saved_values_arg : at::Tensor();
  if (!chains.empty()) {
    TORCH_CHECK(our_attention || int8_cache, "decode_layers: a draft tree needs our attention kernels or an int8 cache");
    for (const auto* saved : {&saved_keys, &saved_values})
      TORCH_CHECK(saved->defined() && saved->is_contiguous() && saved->scalar_type() == x.scalar_type() &&
                      saved->sizes() == at::IntArrayRef({layers, T, KV, D}),
                  "decode_layers: a draft tree's saved keys and values must be contiguous [layers, T, KV, D] in x's dtype");
  }
  // Our kernels' threads spin through the step only where every parallel loop of it is ours: torch's
  // own (dense linears, its attention) wake OpenMP threads, which would queue behind the spinners.
  const bool all_ours = our_attention && std::all_of(kinds.begin(), kinds.end(), [](int64_t kind) {
    return kind == kInt8Dot || kind == kInt4Dot;
  });
  std::optional<step_pool::AwakeScope> awake;
  if (all_ours) awake.emplace();
  if (all_ours) {
    auto done = layers_without_aten(x, cos, sin, keys, values, key_scales, value_scales, start, norms, qk_norms, linear_tensors, kinds, has_bias,
                                    out_features, H, KV, D, intermediate, eps, capture, capture_into, capture_columns,
                                    chains, saved_keys, saved_values);
    if (done) return *done;
  }
  std::vector<at::Tensor> captured;
  size_t next_capture = 0;
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto linear = [&](int64_t which) {
      int64_t i = layer * 4 + which;
      return Linear{kinds[i], linear_tensors[3 * i], linear_tensors[3 * i + 1], linear_tensors[3 * i + 2],
                    has_bias[i] != 0, out_features[i], group_size};
    };
    // attention
    auto h = rms_norm(x, norms[2 * layer], eps);
    auto qkv = linear(0)(h).view({T, H + 2 * KV, D});
    at::Tensor q, k;
    if (qk_norm) {
      q = rope(rms_norm(qkv.slice(1, 0, H), qk_norms[2 * layer], eps), cos, sin);
      k = rope(rms_norm(qkv.slice(1, H, H + KV), qk_norms[2 * layer + 1], eps), cos, sin);
    } else {
      auto qk = rope(qkv.slice(1, 0, H + KV), cos, sin);
      q = qk.slice(1, 0, H);
      k = qk.slice(1, H);
    }
    auto v = qkv.slice(1, H + KV);
    auto layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);
    at::Tensor attended;
    if (!chains.empty()) {  // a draft tree: each chain on its path's keys (tree_chains)
      saved_keys.select(0, layer).copy_(k);
      saved_values.select(0, layer).copy_(v);
      if (!int8_cache) q = q.to(keys.scalar_type());
      attended = at::empty(q.sizes(), q.options());
      // all its chains in one call (causal_attention.cpp, attend_tree), q and the new rows in the
      // cache's dtype (an int8 cache: in x's, as causal_attention_int8 takes them)
      const auto rows = q.contiguous(), new_keys = k.to(q.scalar_type()).contiguous(), new_values = v.to(q.scalar_type()).contiguous();
      TORCH_CHECK(layer_keys.stride(2) == 1 && layer_keys.stride(1) == D && layer_values.strides() == layer_keys.strides() &&
                      (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
                  "decode_layers: a draft tree needs a cache [KV, L, D] with rows of D contiguous and bf16 or fp32 rows, got ",
                  layer_keys.strides(), " and ", q.scalar_type());
      auto attend = [&](auto type) {
        using E = decltype(type);
        if (int8_cache) {
          const auto layer_key_scales = key_scales.select(0, layer), layer_value_scales = value_scales.select(0, layer);
          TORCH_CHECK(layer_key_scales.stride(1) == 1 && layer_value_scales.strides() == layer_key_scales.strides() &&
                          layer_values.strides() == layer_keys.strides(),
                      "decode_layers: an int8 cache's scales must be [KV, L] rows alike for keys and values");
          tree_attention_int8_into(rows.data_ptr<E>(), T, H, D, layer_keys.data_ptr<uint8_t>(), layer_values.data_ptr<int8_t>(),
                                   layer_key_scales.data_ptr<float>(), layer_value_scales.data_ptr<float>(), KV,
                                   layer_keys.size(1), layer_keys.stride(0), layer_key_scales.stride(0), start, chains,
                                   new_keys.data_ptr<E>(), KV * D, new_values.data_ptr<E>(), KV * D, attended.data_ptr<E>());
        } else {
          tree_attention_into(rows.data_ptr<E>(), T, H, D, layer_keys.data_ptr<E>(), layer_values.data_ptr<E>(), KV,
                              layer_keys.size(1), layer_keys.stride(0), start, chains, new_keys.data_ptr<E>(), KV * D,
                              new_values.data_ptr<E>(), KV * D, attended.data_ptr<E>());
        }
      };
      if (q.scalar_type() == at::kBFloat16) attend(at::BFloat16{});
      else attend(float{});
    } else if (int8_cache) {
      const auto layer_key_scales = key_scales.select(0, layer), layer_value_scales = value_scales.select(0, layer);
      quantize_kv(k, v, layer_keys, layer_values, layer_key_scales, layer_value_scales, start);
      attended = causal_attention_int8(q, layer_keys, layer_values, layer_key_scales, layer_value_scales, start);
    } else {
      layer_keys.slice(1, start, start + T).copy_(k.transpose(0, 1));
      layer_values.slice(1, start, start + T).copy_(v.transpose(0, 1));
      q = q.to(keys.scalar_type());
      if (our_attention) {
        attended = causal_attention(q, layer_keys, layer_values, start);
      } else {
        std::vector<at::Tensor> parts;
        for (size_t g = 0; g < group_starts.size(); ++g) {
          parts.push_back(grouped_query_attention(q.slice(0, group_starts[g], group_ends[g]),
                                                  layer_keys.slice(1, 0, group_keys[g]),
                                                  layer_values.slice(1, 0, group_keys[g]), group_masks[g]));
        }
        attended = at::cat(parts);
      }
    }
    x = x + linear(1)(attended.reshape({T, H * D}).to(x.scalar_type()));
    // feed-forward
    auto gate_up = linear(2)(rms_norm(x, norms[2 * layer + 1], eps));
    // as model.FeedForward: our SiLU product for bf16 rows, torch's otherwise
    auto act = gate_up.scalar_type() == at::kBFloat16 ? silu_product(gate_up)
                                                       : at::silu(gate_up.slice(-1, 0, intermediate)) * gate_up.slice(-1, intermediate);
    x = x + linear(3)(act);
    if (next_capture < capture.size() && capture[next_capture] == layer) {
      if (capture_into.defined()) {
        capture_into.narrow(1, capture_columns[next_capture], x.size(1)).copy_(x);
      } else {
        captured.push_back(x.clone());
      }
      ++next_capture;
    }
  }
  captured.insert(captured.begin(), x);
  return captured;
}

// The DFlash drafter's layers over one block (drafters/dflash.py, DFlashDraftModel.forward as the
// server runs it: int8 or int4 linears on our kernels, fused kv_proj and gate_up_proj, q/k norms, bf16
// activations, an fp32 or bf16 cache): the same kernels and roundings in the same order as that
// Python code, so the same drafts (tests/model/test_dflash.py), without its ~30 ATen calls a layer
// (most of a proposal's 3 ms on Zen 4: bench/propose.py). x [B, C] the block's rows (positions
// ctx_start + S..), context [S, C] the new context rows (ctx_start..); keys/values the drafter's
// cache [layers, KV, max, D]: the context's and the block's keys are written at ctx_start.. (the
// block's are overwritten by the next proposal). Every block row attends to every key: the rows
// as the query heads of one row at the last position (block_attention). Returns x after the layers.
at::Tensor draft_layers(const at::Tensor& x_in, const at::Tensor& context, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& keys, const at::Tensor& values, int64_t ctx_start,
                        const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& linears, int64_t H, int64_t KV,
                        int64_t D, int64_t intermediate, double eps) {
  using bf16 = at::BFloat16;
  at::NoGradGuard no_grad;
  const auto kBf16 = at::kBFloat16;
  const int64_t layers = keys.size(0), B = x_in.size(0), C = x_in.size(1), S = context.size(0), N = S + B, I = intermediate;
  const int64_t G = H / KV, end = ctx_start + N;
  const bool f32_cache = keys.scalar_type() == at::kFloat;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == kBf16 && context.scalar_type() == kBf16 && (S == 0 || context.size(1) == C),
              "draft_layers: x ", x_in.sizes(), " ", x_in.scalar_type(), ", context ", context.sizes(), " ", context.scalar_type());
  TORCH_CHECK((f32_cache || keys.scalar_type() == kBf16) && values.scalar_type() == keys.scalar_type() && keys.dim() == 4 &&
                  keys.size(1) == KV && keys.size(3) == D && keys.stride(3) == 1 && keys.stride(2) == D &&
                  values.strides() == keys.strides() && values.sizes() == keys.sizes() && end <= keys.size(2),
              "draft_layers: cache ", keys.sizes(), " ", keys.scalar_type(), " for positions up to ", end);
  TORCH_CHECK(cos.scalar_type() == kBf16 && sin.scalar_type() == kBf16 && cos.dim() == 3 && cos.size(2) == D && cos.stride(2) == 1 &&
                  sin.strides() == cos.strides() && cos.size(0) >= end && H % KV == 0 && D % 16 == 0 && D <= 256,
              "draft_layers: rope tables ", cos.sizes(), ", ", H, " heads over ", KV, " of ", D);
  TORCH_CHECK(int64_t(norms.size()) == 4 * layers && int64_t(linears.size()) == 10 * layers, "draft_layers: ", norms.size(),
              " norms and ", linears.size(), " linear tensors for ", layers, " layers (4 and 10 a layer)");
  const int64_t in_features[5] = {C, C, H * D, C, I}, outputs[5] = {H * D, 2 * KV * D, C, 2 * I, C};
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int which = 0; which < 5; ++which) {
      const auto &codes = linears[10 * layer + 2 * which], &scales = linears[10 * layer + 2 * which + 1];
      // int8 (codes [N/16, K/32, 8, 64], fp32 scales [N]) or int4 ([N/16, K/32, 4, 64], bf16 scales
      // and zeros [N/16, K/32, 2, 16]), told apart by the codes' bytes a group
      const bool int4 = codes.dim() == 4 && codes.size(2) * codes.size(3) == 256;
      TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                      codes.size(0) * 16 == outputs[which] && codes.size(1) * 32 == in_features[which] &&
                      (int4 || codes.size(2) * codes.size(3) == 512) && scales.is_contiguous() &&
                      scales.scalar_type() == (int4 ? kBf16 : at::kFloat) &&
                      scales.numel() == (int4 ? codes.size(0) * codes.size(1) * 32 : outputs[which]),
                  "draft_layers: linear ", which, " of layer ", layer, " is neither int8 nor int4 in quant.py's layout: ",
                  codes.sizes(), " codes, ", scales.sizes(), " ", scales.scalar_type(), " scales");
    }
    for (int n = 0; n < 4; ++n) {
      const auto& w = norms[4 * layer + n];
      TORCH_CHECK(w.scalar_type() == kBf16 && w.is_contiguous() && w.numel() == (n < 2 ? C : D), "draft_layers: norm ", n,
                  " of layer ", layer, ": ", w.sizes(), " ", w.scalar_type());
    }
  }
  step_pool::AwakeScope awake;
  auto x_out = x_in.contiguous().clone();
  bf16* x = x_out.data_ptr<bf16>();
  const auto context_rows = context.contiguous();
  bf16* h = scratch_rows(N * C + B * H * D * 2 + N * 2 * KV * D + B * C + B * 2 * I + B * I + D);
  bf16* q = h + N * C;           // [B, H, D] after q_proj, then normed and rotated in place
  bf16* attended = q + B * H * D;  // [B, H * D]
  bf16* kv = attended + B * H * D;  // [N, 2 KV D]
  bf16* projected = kv + N * 2 * KV * D;
  bf16* gate_up = projected + B * C;
  bf16* act = gate_up + B * 2 * I;
  bf16* normed = act + B * I;  // one head's row
  std::vector<float> heads_f32(f32_cache ? size_t(B * H * D) : 0), out_f32(f32_cache ? size_t(B * H * D) : 0);
  std::vector<bf16> heads_bf16(f32_cache ? 0 : size_t(B * H * D)), out_bf16(f32_cache ? 0 : size_t(B * H * D));
  const bf16 *cos_rows = cos.data_ptr<bf16>(), *sin_rows = sin.data_ptr<bf16>();
  const int64_t rope_stride = cos.stride(0);
  const float epsilon = float(eps);
  auto linear = [&](int64_t layer, int which, const bf16* in, int64_t rows, bf16* out) {
    const auto &codes = linears[10 * layer + 2 * which], &scales = linears[10 * layer + 2 * which + 1];
    const bool int4 = scales.scalar_type() == kBf16;  // checked above
    quantized_matmul_into(in, rows, in_features[which], codes.data_ptr<uint8_t>(),
                          int4 ? static_cast<const void*>(scales.data_ptr<bf16>()) : scales.data_ptr<float>(),
                          outputs[which], int4, out);
  };
  for (int64_t layer = 0; layer < layers; ++layer) {
    const bf16 *input_norm = norms[4 * layer].data_ptr<bf16>(), *post_norm = norms[4 * layer + 1].data_ptr<bf16>();
    const bf16 *q_norm = norms[4 * layer + 2].data_ptr<bf16>(), *k_norm = norms[4 * layer + 3].data_ptr<bf16>();
    // h = [context; input_layernorm(x)]: the keys' rows; the queries are the block's
    if (S) std::memcpy(h, context_rows.data_ptr<bf16>(), sizeof(bf16) * S * C);
    bf16* block_h = h + S * C;
    rms_norm_rows(x, input_norm, block_h, B, C, epsilon);
    linear(layer, 0, block_h, B, q);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t position = ctx_start + S + b;
      for (int64_t head = 0; head < H; ++head) {
        bf16* row = q + (b * H + head) * D;
        rms_norm_rows(row, q_norm, normed, 1, D, epsilon);
        rope_row(normed, cos_rows + position * rope_stride, sin_rows + position * rope_stride, row, D);
      }
    }
    linear(layer, 1, h, N, kv);
    const int64_t layer_at = layer * keys.stride(0);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t position = ctx_start + n;
      for (int64_t head = 0; head < KV; ++head) {
        rms_norm_rows(kv + n * 2 * KV * D + head * D, k_norm, normed, 1, D, epsilon);
        alignas(32) bf16 rotated[256];
        rope_row(normed, cos_rows + position * rope_stride, sin_rows + position * rope_stride, rotated, D);
        const bf16* value = kv + n * 2 * KV * D + (KV + head) * D;
        const int64_t at = layer_at + head * keys.stride(1) + position * D;
        if (f32_cache) {
          float *k_out = keys.data_ptr<float>() + at, *v_out = values.data_ptr<float>() + at;
          for (int64_t d = 0; d < D; ++d) k_out[d] = float(rotated[d]), v_out[d] = float(value[d]);
        } else {
          std::memcpy(keys.data_ptr<bf16>() + at, rotated, sizeof(bf16) * D);
          std::memcpy(values.data_ptr<bf16>() + at, value, sizeof(bf16) * D);
        }
      }
    }
    // the block's rows as query heads of one row: KV head k's heads (b, g) at (k B + b) G + g
    for (int64_t k = 0; k < KV; ++k)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < G; ++g) {
          const bf16* from = q + (b * H + k * G + g) * D;
          const int64_t to = ((k * B + b) * G + g) * D;
          if (f32_cache) for (int64_t d = 0; d < D; ++d) heads_f32[to + d] = float(from[d]);
          else std::memcpy(heads_bf16.data() + to, from, sizeof(bf16) * D);
        }
    if (f32_cache) {
      causal_attention_f32_into(heads_f32.data(), 1, KV * B * G, D, keys.data_ptr<float>() + layer_at,
                                values.data_ptr<float>() + layer_at, KV, end, keys.stride(1), end - 1, out_f32.data());
    } else {
      causal_attention_bf16_into(heads_bf16.data(), 1, KV * B * G, D, keys.data_ptr<bf16>() + layer_at,
                                 values.data_ptr<bf16>() + layer_at, KV, end, keys.stride(1), end - 1, out_bf16.data());
    }
    for (int64_t k = 0; k < KV; ++k)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t from = ((k * B + b) * G + g) * D;
          bf16* to = attended + (b * H + k * G + g) * D;
          if (f32_cache) for (int64_t d = 0; d < D; ++d) to[d] = bf16(out_f32[from + d]);
          else std::memcpy(to, out_bf16.data() + from, sizeof(bf16) * D);
        }
    linear(layer, 2, attended, B, projected);
    add_rows(x, projected, x, B * C);
    rms_norm_rows(x, post_norm, block_h, B, C, epsilon);
    linear(layer, 3, block_h, B, gate_up);
    {
      auto gate = at::from_blob(gate_up, {B, 2 * I}, at::TensorOptions().dtype(kBf16)).slice(1, 0, I);
      auto silu = at::silu(gate).contiguous();
      const bf16* s = silu.data_ptr<bf16>();
      for (int64_t b = 0; b < B; ++b) multiply_rows(s + b * I, gate_up + b * 2 * I + I, act + b * I, I);
    }
    linear(layer, 4, act, B, projected);
    add_rows(x, projected, x, B * C);
  }
  return x_out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  // The calls that compute let go of the GIL while they run (they touch no Python object; their
  // arguments are converted before and their results after): the engine runs them on its own thread
  // while the HTTP server's event loop shares the process, and a prefill chunk deep in a prompt holds
  // a call for up to a second (a 28K-token prompt kept /health waiting 432 ms at the median).
  const auto without_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("argmax_rows", &argmax_rows, without_gil, "torch.argmax(x, dim=-1) of fp32 rows, on this thread (logits.cpp)", arg("x"));
  m.def("widen_to_fp32", &widen_to_fp32, without_gil, "bf16 -> fp32 (exact), on this thread (logits.cpp)", arg("x"));
  m.def("silu_product_kind", [] { return std::string(silu_lanes_available() ? "lanes-r1" : "scalar"); },
        "which sequence silu_product computes here (its bits: lanes, 8 or 16 alike, or std::exp)");
  m.def("silu_product", &silu_product, without_gil, "model.FeedForward's silu(gate) * up over bf16 rows [..., 2I] -> [..., I]", arg("gate_up"));
  m.def("rms_norm", &rms_norm, without_gil, "model.RMSNorm, row by row (bf16 or fp32)", arg("x"), arg("weight"), arg("eps"));
  m.def("vnni_available", &vnni_available, "whether this CPU has AVX512-VNNI for quantized_linear.cpp's kernels");
  m.def("int8dot_available", &int8dot_available, "whether this CPU can run quantized_linear.cpp's kernels (AVX2)");
  m.def("int8dot_isa", &int8dot_isa, "which instructions they use for a call with `rows` rows of int4 or int8 weights",
        arg("rows"), arg("int4") = false);
  m.def("amx_available", &amx_available, "whether they use AMX tiles for 5 rows or more here");
  m.def("int4_matmul", &int4_matmul, without_gil, "x [M, K] bf16 . int4 weights (quant.py's layout) -> [M, N] bf16",
        arg("x"), arg("codes"), arg("scales"));
  m.def("int8_matmul", &int8_matmul, without_gil, "x [M, K] bf16 . int8 weights (quant.py's layout) -> [M, N] bf16",
        arg("x"), arg("codes"), arg("scales"));
  m.def("layers_without_aten_calls", [] { return layers_without_aten_calls; },
        "decode_layers calls that ran without ATen calls between the kernels so far");
  m.def("step_pool_loops", &step_pool::loops_run, "parallel loops run by step_pool.cpp's spinning workers so far");
  m.def("causal_attention_available", &causal_attention_available, "whether this CPU runs causal_attention (AVX2 + FMA)");
  m.def("causal_attention_isas", &causal_attention_isas, "every value DFLASH_ATTENTION_ISA may choose on this CPU");
  m.def("causal_attention_isa", &causal_attention_isa,
        "what a bf16 cache is attended with: avx512-bf16 (bf16 dot products) or avx2 (DFLASH_ATTENTION_ISA=avx2 forces it)");
  m.def("chunk_softmax_isas", &chunk_softmax_isas, "the softmax implementations causal_attention.cpp has here (same bits)");
  m.def("softmax_rows", &softmax_rows, without_gil, "causal_attention.cpp's chunk softmax over rows [R, 256] with one implementation -> (e, m, l)",
        arg("scores"), arg("seen"), arg("isa"));
  m.def("causal_attention_revision", &causal_attention_revision,
        "the revision of the sequence of operations over a bf16 cache (bumped when its bits change)");
  m.def("causal_attention", &causal_attention, without_gil,
        "q [T, H, D] at positions start.. over keys/values [KV, L, D] -> [T, H, D], row-invariant (causal_attention.cpp)",
        arg("q"), arg("keys"), arg("values"), arg("start"));
  m.def("int8_kv_available", &int8_kv_available, "whether this CPU attends over an int8 cache (AVX512-VNNI)");
  m.def("int8_kv_tiles", &int8_kv_tiles,
        "whether an int8 cache's calls of many rows (16 and more a head and chunk) multiply on AMX tiles, for head dim D");
  m.def("int8_kv_revision", &int8_kv_revision, "the revision of the sequence of operations over an int8 cache");
  m.def("quantize_kv", &quantize_kv, without_gil, "k, v [T, KV, D] -> rows start.. of an int8 layer: codes and scales (causal_attention.cpp)",
        arg("k"), arg("v"), arg("keys"), arg("values"), arg("key_scales"), arg("value_scales"), arg("start"));
  m.def("causal_attention_int8", &causal_attention_int8, without_gil,
        "causal_attention over an int8 layer (keys uint8 code + 128, values int8, scales [KV, L]) -> [T, H, D] in q's dtype",
        arg("q"), arg("keys"), arg("values"), arg("key_scales"), arg("value_scales"), arg("start"));
  m.def("draft_layers", &draft_layers, without_gil, "a DFlash drafter's layers over its block, as served (drafters/dflash.py)",
        arg("x"), arg("context"), arg("cos"), arg("sin"), arg("keys"), arg("values"), arg("ctx_start"), arg("norms"),
        arg("linears"), arg("H"), arg("KV"), arg("D"), arg("intermediate"), arg("eps"));
  m.def("decode_layers", &decode_layers, without_gil, "decoder layers over decode and verification rows, and prefill rows where every linear is ours (see model.py)", arg("x"), arg("cos"),
        arg("sin"), arg("keys"), arg("values"), arg("key_scales"), arg("value_scales"), arg("start"), arg("norms"), arg("qk_norms"), arg("linear_tensors"),
        arg("kinds"), arg("has_bias"), arg("out_features"), arg("group_size"), arg("group_starts"),
        arg("group_ends"), arg("group_keys"), arg("group_masks"), arg("our_attention"), arg("num_heads"), arg("num_kv_heads"),
        arg("head_dim"), arg("intermediate"), arg("eps"), arg("capture"), arg("capture_into") = pybind11::none(),
        arg("capture_columns") = std::vector<int64_t>{}, arg("tree_parents") = std::vector<int64_t>{},
        arg("saved_keys") = pybind11::none(), arg("saved_values") = pybind11::none());
}
