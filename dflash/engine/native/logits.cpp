// What a step does with its logits: widen the LM head's bf16 rows to fp32, and a greedy argmax.
//
// Why: torch's argmax over one row of 49152 fp32 logits took ~45 us (a scalar reduction that
// tracks indices), a verification's 8 rows ~350 us, 5% of a 1+7-row step of the embedded model on
// Zen 4; its bf16 -> fp32 copy of a row took 35-65 us (on 2 threads it wakes OpenMP's). Here one
// thread and 8 or 16 lanes.
//
// argmax_rows has torch.argmax's meaning exactly: the first index of the largest value, and where a
// row holds NaN the first NaN (torch orders NaN above everything).
#include <torch/extension.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace {

#define LOGITS_AVX2_TARGET __attribute__((target("avx2")))
#define LOGITS_AVX512_TARGET __attribute__((target("avx2,avx512f")))

bool avx2_available() {
  static const bool available = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("avx2"));
  }();
  return available;
}

bool avx512_available() {
  static const bool available = [] {
    __builtin_cpu_init();
    return avx2_available() && __builtin_cpu_supports("avx512f");
  }();
  return available;
}

int64_t argmax_scalar(const float* x, int64_t n, int64_t from = 0, int64_t best = 0) {
  for (int64_t i = from; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// The largest value's first index over [0, n) without NaN (the caller checks), on 16 lanes: each
// lane keeps its strictly larger values (so its first index of its max), then the lanes' maxima
// are merged, the smallest index among the equal ones winning.
LOGITS_AVX512_TARGET int64_t argmax_16_lanes(const float* x, int64_t n, bool& saw_nan) {
  const int64_t whole = n / 16 * 16;
  if (whole == 0) {
    saw_nan = false;
    for (int64_t i = 0; i < n; ++i) saw_nan |= std::isnan(x[i]);
    return saw_nan ? 0 : argmax_scalar(x, n);
  }
  __m512 best = _mm512_loadu_ps(x);
  __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = best_index;
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (int64_t i = 16; i < whole; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    index = _mm512_add_epi32(index, sixteen);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, larger, v);
    best_index = _mm512_mask_mov_epi32(best_index, larger, index);
  }
  for (int64_t i = whole; i < n; ++i) nan |= std::isnan(x[i]) ? 1 : 0;
  saw_nan = nan != 0;
  if (saw_nan) return 0;
  alignas(64) float values[16];
  alignas(64) int32_t indices[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(indices, best_index);
  int64_t winner = indices[0];
  float top = values[0];
  for (int lane = 1; lane < 16; ++lane) {
    if (values[lane] > top || (values[lane] == top && indices[lane] < winner)) top = values[lane], winner = indices[lane];
  }
  return argmax_scalar(x, n, whole, winner);  // the tail after the lanes' result
}

LOGITS_AVX2_TARGET void widen_8_lanes(const at::BFloat16* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
  for (; i < n; ++i) out[i] = float(in[i]);
}

}  // namespace

// x [..., V] fp32 -> int64 [...]: torch.argmax(x, dim=-1), row by row on this thread.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0, "argmax_rows: expected fp32 [..., V] with V > 0, got ",
              x.scalar_type(), " ", x.sizes());
  const auto input = x.contiguous();
  const int64_t V = input.size(-1), rows = input.numel() / V;
  auto out = at::empty(input.sizes().slice(0, input.dim() - 1), at::TensorOptions().dtype(at::kLong));
  const float* data = input.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  const char* forced = std::getenv("DFLASH_ARGMAX");  // "scalar": the other path, for tests
  const bool lanes = avx512_available() && !(forced != nullptr && std::string(forced) == "scalar");
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = data + r * V;
    bool saw_nan = true;
    const int64_t found = lanes ? argmax_16_lanes(row, V, saw_nan) : 0;
    indices[r] = saw_nan ? argmax_scalar(row, V) : found;
  }
  return out;
}

// x bf16 -> the same values as fp32 (exact), on this thread.
at::Tensor widen_to_fp32(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "widen_to_fp32: expected bf16, got ", x.scalar_type());
  const auto input = x.contiguous();
  auto out = at::empty(input.sizes(), input.options().dtype(at::kFloat));
  const at::BFloat16* in = input.data_ptr<at::BFloat16>();
  float* o = out.data_ptr<float>();
  if (avx2_available()) widen_8_lanes(in, o, input.numel());
  else for (int64_t i = 0; i < input.numel(); ++i) o[i] = float(in[i]);
  return out;
}
