// Causal grouped-query attention over the KV cache, row-invariant by construction (AVX2 + FMA).
//
// Why: speculation is lossless only if a verified row gets exactly the logits a decode step gives
// it, and a prefilled row exactly those of a decoded one (model.py, KEY_BUCKET). torch's CPU flash
// kernel keeps that where the CPU has bf16 hardware and the cache is bf16, but on AVX2-only CPUs its
// fp32 and bf16 kernels both compute a row differently with 3 query rows than with 24 (measured on
// an AMD EPYC: tests/model/test_causal_attention.py). Here every row is computed by one fixed
// sequence of operations that depends only on its position, never on the other rows of the call:
//
//   Keys are cut into chunks of kChunk positions from 0. For each chunk a row sees (keys 0..its
//   position), a partial (m, l, o): the scores s_j = q.k_j / sqrt(D) (8 fma lanes over D, then one
//   fixed reduction tree), m = max s_j, e_j = exp(s_j - m) (one polynomial), l = sum e_j (8 lanes by
//   j mod 8, one tree), o = sum e_j v_j in j order. The partials are merged in chunk order, always
//   by the same formula, and out = o / l. (Over a bf16 cache on a CPU with AVX512-BF16, o is a sum
//   of bf16 dot products over key pairs instead, and with bf16 queries the scores are bf16 dot
//   products with their own tree: the sections "bf16 dot products for the values / the scores".)
//
// Which thread computes which partial changes nothing: few rows (decode, verification) run one
// task per (KV head, chunk) so a long context uses both cores, many rows (prefill) one per (KV
// head, block of tokens) walking the chunks in order. Keys and values may be bf16 (converted to
// fp32 exactly, by a shift) or fp32; on AVX2 this reads a bf16 cache at memory speed, where torch's
// bf16 attention measured 4x slower than its fp32 one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"
#include "step_pool.h"
#include "tree_chain.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

bool amx_available();  // quantized_linear.cpp: AMX present and its register state granted

namespace {

#define AVX2_TARGET __attribute__((target("avx2,fma")))
// gcc -O2 keeps short constant loops as loops, with their __m256 arrays in memory: unroll them.
#define UNROLLED _Pragma("GCC unroll 32")

constexpr int64_t kChunk = 256;      // key positions per partial; fixed, so results never depend on it
constexpr int64_t kMaxDim = 256;     // the largest head_dim served
constexpr int64_t kFewRows = 64;     // up to this many query rows per KV head: parallel over chunks
// Many rows: tokens per task (x G query heads). Each task reads every key and value it sees once per
// chunk for all its rows, so a prefill chunk at depth reads the cache R / (64 G) times. 4 -> 16
// tokens (bench/attention.py, 1 thread, prefill 256 at 16K on an AMX VM): 83 -> 50 ms a layer on
// tiles (48 rows are 3 whole tiles), 164 -> 150 on bf16 dot products, 199 -> 171 over an fp32 cache;
// 16 -> 64 on tiles (the same VM, a later build): 43 -> 30 ms on 1 thread, 21 -> 17-18 ms on 2
// (128: no better on 2 threads, and fewer tasks to share). A row's partials and their merge order
// do not depend on the rows beside it, so neither do its bits.
constexpr int64_t kTokensPerTask = 64;
constexpr int64_t kPrefetchKeys = 32;  // keys (and values) ahead that are prefetched
constexpr int kTokenRows = 3;          // rows of one token sharing each key and value load (decode)

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// exp for x <= 0 (scores minus their max) on 8 lanes, one fixed sequence, so equal inputs give equal
// outputs whatever lane or call they sit in: t = x log2(e), n = t rounded to the nearest whole number,
// f = t - n in [-1/2, 1/2] (exact: f is a multiple of t's last place), 2^f by a degree-5 polynomial
// (fitted for relative error: at most 1.6e-7 in fp32), times 2^n. x is clamped at -86 first, so
// n >= -124 and the product is a normal number: exact, rounded once. t's own rounding adds up to
// ~4e-6 of relative error near the clamp (terms of ~1e-37) and ~1e-7 near 0, where the terms that
// count are. Revision 3 of the attention sequence; before it, Cephes' two-constant range reduction
// and polynomial, ~14 instructions on 16 lanes against ~10.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kExp2Poly[5] = {0.6931470036506653f, 0.24022242426872253f, 0.05550733581185341f,
                                 0.009671509265899658f, 0.0013264708686619997f};  // f^1 .. f^5

AVX2_TARGET inline __m256 exp_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.0f)), _mm256_set1_ps(kLog2e));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 y = _mm256_set1_ps(kExp2Poly[4]);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kExp2Poly[3]));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kExp2Poly[2]));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kExp2Poly[1]));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kExp2Poly[0]));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

AVX2_TARGET inline float sum_of(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7)): one fixed tree
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

AVX2_TARGET inline float max_of(__m256 v) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

// The 8 sums of 8 vectors, lane i = sum_of(v[i]) computed with the same tree (hadd pairs lanes
// (0,1),(2,3) within each 128-bit half, which is (0+1)+(2+3) and (4+5)+(6+7), then the halves):
// used for 8 keys' scores at once; sum_of is never used for scores.
AVX2_TARGET inline __m256 sums_of_eight(const __m256* v) {
  __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // lanes: 0 1 2 3 | 0 1 2 3 (low, high halves)
  __m256 low = _mm256_permute2f128_ps(ab, cd, 0x20), high = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(low, high);
}

// The 4 sums of 4 vectors, lane i = sum_of(v[i]) computed with the same tree (hadd pairs lanes
// (0,1),(2,3) within each 128-bit half, which is (0+1)+(2+3) and (4+5)+(6+7), then the halves):
// used for 4 keys' scores at once; sum_of is never used for scores.
AVX2_TARGET inline __m128 sums_of_four(const __m256* v) {
  __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(ab), _mm256_extractf128_ps(ab, 1));
}

template <typename T>
AVX2_TARGET inline __m256 load8(const T* p);

template <>
AVX2_TARGET inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}

template <>
AVX2_TARGET inline __m256 load8<at::BFloat16>(const at::BFloat16* p) {  // exact: bf16 is fp32's top half
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// One row's softmax state over a chunk (or the chunks merged so far): D + 2 floats, m, l, then o[D].
// Kept in plain float arrays, never zero-filled: a verification at 32K holds thousands of them.
struct Partial {
  float* p;
  float& m() const { return p[0]; }
  float& l() const { return p[1]; }
  float* o() const { return p + 2; }
};

std::unique_ptr<float[]> partial_buffer(int64_t count, int64_t D) { return std::unique_ptr<float[]>(new float[count * (D + 2)]); }

// Rows of one KV head: query row i is token t = i / G of the call, head g = i % G, at position
// start + t, q at q + (t * H + h * G + g) * D.
template <typename QT>
struct Rows {
  const QT* q;
  int64_t start, T, G, H, D;
  float scale;
  bool amx = false;  // bf16 scores and values on AMX tiles (amx_scores, amx_values): amx_rows
  int64_t count() const { return T * G; }
  int64_t position(int64_t i) const { return start + i / G; }
  const QT* query(int64_t h, int64_t i) const { return q + ((i / G) * H + h * G + i % G) * D; }
};

// A row's softmax over the `seen` keys it sees in a chunk: scores s become e_j = exp(s_j - m) in
// place (zero past `seen` up to the next multiple of 8), m and l = sum e_j go into the partial.
// Never inlined, so the decode path and the several-token path run the same instructions (see merge).
//
// Two implementations with the same bits: m is a max (exact in any order); each e_j is
// exp_nonpositive's fixed sequence on its own lane; l is summed on 8 lanes, lane i taking e_i, e_i+8,
// e_i+16, ... in order, then sum_of's tree. The AVX512 one computes exp on 16 lanes and adds each
// half in turn (the same 8-lane order), 0.63x the time of the AVX2 one at 256 keys (AMX VM);
// chunk_softmax picks the AVX512 one wherever the CPU has it, and tests compare both (softmax_rows).
__attribute__((noinline)) AVX2_TARGET void chunk_softmax_avx2(float* s, int64_t seen, const Partial& p) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = seen & ~int64_t(7);  // whole vectors of visible scores; only the last is masked
  const __m256 visible = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(float(full))), _mm256_set1_ps(float(seen)), _CMP_LT_OQ);
  __m256 running_max = minus_inf;
  for (int64_t j = 0; j < full; j += 8) running_max = _mm256_max_ps(running_max, _mm256_loadu_ps(s + j));
  if (full < seen) running_max = _mm256_max_ps(running_max, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(s + full), visible));
  const float m = max_of(running_max);
  const __m256 shift = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  if (full < seen) {
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + full), shift)), visible);
    _mm256_storeu_ps(s + full, e);
    total = _mm256_add_ps(total, e);
  }
  p.m() = m;
  p.l() = sum_of(total);
}

#define AVX512_TARGET __attribute__((target("avx2,fma,avx512f,avx512dq")))

bool cpu_has_avx512f_dq() {
  __builtin_cpu_init();
  return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

AVX512_TARGET inline __m512 exp_nonpositive_16(__m512 x) {  // exp_nonpositive's operations on 16 lanes
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-86.0f)), _mm512_set1_ps(kLog2e));
  // vreduceps (AVX512DQ) gives t - n in one instruction, exact as the subtraction is (to nearest:
  // rounded down, t - floor(t) is not always exact, and vreduceps rounds it down where subps rounds
  // to nearest); vscalefps multiplies by 2^floor(n) = 2^n itself, an exact product rounded once as
  // exp_nonpositive's multiplication by 2^n's bits is: the same bits.
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(t, f);
  __m512 y = _mm512_set1_ps(kExp2Poly[4]);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[3]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[2]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[1]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[0]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

__attribute__((noinline)) AVX512_TARGET void chunk_softmax_avx512(float* s, int64_t seen, const Partial& p) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t sixteens = seen & ~int64_t(15), full = seen & ~int64_t(7);
  const __m256 visible = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(float(full))), _mm256_set1_ps(float(seen)), _CMP_LT_OQ);
  __m512 wide_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < sixteens; j += 16) wide_max = _mm512_max_ps(wide_max, _mm512_loadu_ps(s + j));
  __m256 running_max = _mm256_max_ps(_mm512_castps512_ps256(wide_max), _mm512_extractf32x8_ps(wide_max, 1));
  if (sixteens < full) running_max = _mm256_max_ps(running_max, _mm256_loadu_ps(s + sixteens));
  if (full < seen) running_max = _mm256_max_ps(running_max, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(s + full), visible));
  const float m = max_of(running_max);
  const __m512 wide_shift = _mm512_set1_ps(m);
  const __m256 shift = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < sixteens; j += 16) {
    const __m512 e = exp_nonpositive_16(_mm512_sub_ps(_mm512_loadu_ps(s + j), wide_shift));
    _mm512_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, _mm512_castps512_ps256(e));  // e_j .. e_j+7, then e_j+8 .. e_j+15
    total = _mm256_add_ps(total, _mm512_extractf32x8_ps(e, 1));
  }
  if (sixteens < full) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + sixteens), shift));
    _mm256_storeu_ps(s + sixteens, e);
    total = _mm256_add_ps(total, e);
  }
  if (full < seen) {
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + full), shift)), visible);
    _mm256_storeu_ps(s + full, e);
    total = _mm256_add_ps(total, e);
  }
  p.m() = m;
  p.l() = sum_of(total);
}

bool chunk_softmax_wide() {
  static const bool wide = cpu_has_avx512f_dq();
  return wide;
}

inline void chunk_softmax(float* s, int64_t seen, const Partial& p) {
  if (chunk_softmax_wide()) return chunk_softmax_avx512(s, seen, p);
  chunk_softmax_avx2(s, seen, p);
}

// A thread's scratch memory, 64-byte aligned (a std::vector of __m512 is not: the element type's
// alignment is dropped as a template argument), grown and never shrunk.
class Scratch {
 public:
  ~Scratch() { std::free(memory_); }
  template <typename T>
  T* get(size_t count) {
    const size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
    if (bytes > bytes_) {
      std::free(memory_);
      memory_ = std::aligned_alloc(64, bytes);
      TORCH_CHECK(memory_ != nullptr, "causal_attention: out of memory for ", bytes, " bytes of scratch");
      bytes_ = bytes;
    }
    return static_cast<T*>(memory_);
  }

 private:
  void* memory_ = nullptr;
  size_t bytes_ = 0;
};

// ---- bf16 dot products for the values (AVX512-BF16: AMD Zen 4, Intel Sapphire Rapids) ----------
//
// Why: with a bf16 cache, half of a verification's or a prefill's arithmetic is o = sum e_j v_j
// (8 tokens x 3 query heads per value), and vdpbf16ps does two bf16 multiply-adds a lane where an
// fp32 fma does one. Where the cache is bf16 and the CPU has it (DFLASH_ATTENTION_ISA=avx2 forces
// the fp32 sequence) a row's values are, after the same scores and softmax as above:
//
//   e_j rounded to bf16 (as torch's own bf16 flash attention rounds its probabilities before
//   multiplying the values); o = sum over key pairs (j, j+1) from the chunk's start, in order, of
//   vdpbf16ps with (e_j, e_j+1) and (v_j, v_j+1) interleaved. Products of bf16 numbers are exact in
//   fp32; vdpbf16ps rounds each addition to nearest and flushes denormals, the same in any lane.
//   Pairs past a row's keys add e = +0 times finite values (or zeros past the keys the call reads):
//   +0 or -0 added to a sum that is never -0, so they change nothing, and a row computed alone
//   (fewer pairs) gets the same bits.
//
// The scores are bf16 dot products too where q is bf16 (the section after this one).
#define BF16DOT_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
}

// Whether a call over a bf16 cache multiplies its values with bf16 dot products.
bool bf16_values_chosen() {
  static const bool available = cpu_has_avx512_bf16();
  const char* forced = std::getenv("DFLASH_ATTENTION_ISA");
  return available && !(forced != nullptr && std::strcmp(forced, "avx2") == 0);
}

template <int D>
struct Bf16Values {
  static constexpr int kVectors = 2 * ((D + 31) / 32);    // interleaved zmm per key pair, o's zmm per row
  static constexpr int kRows = D <= 32 ? 8 : D == 64 ? 6 : D == 128 ? 3 : 1;  // rows sharing each load
};

// chunk_softmax_avx512 of four rows that each see the whole chunk (kChunk apart; their partials
// `stride` floats apart), their operations interleaved: l's sum is a chain of dependent adds (8
// lanes, key order), 128 cycles of latency a row, which one row alone leaves the core waiting on.
// Each row gets the same operations as chunk_softmax_avx512 (with no partial vectors), so the
// same bits. For a bf16 values path: e goes into `pairs` (row r's at pairs + r * kChunk / 2) as
// bf16_pairs would write it, not back into s: the fp32 e were written and read again only for that.
// A `scale` other than 1: s holds sums still to be multiplied by it (amx_tokens_scores).
__attribute__((noinline)) BF16DOT_TARGET void chunk_softmax_avx512_four_whole(float* s, float* partials, int64_t stride,
                                                                             int32_t* pairs, float scale) {
  constexpr int R = 4;
  __m512 wide_max[R];
  UNROLLED for (int r = 0; r < R; ++r) wide_max[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  if (scale != 1.0f) {  // sums not yet scaled (amx_tokens_scores): scores = sum * scale, as gather_scores makes them
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < kChunk; j += 16) {
      UNROLLED for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + r * kChunk + j), scaled);
        _mm512_storeu_ps(s + r * kChunk + j, v);
        wide_max[r] = _mm512_max_ps(wide_max[r], v);
      }
    }
  } else {
    for (int64_t j = 0; j < kChunk; j += 16)
      UNROLLED for (int r = 0; r < R; ++r) wide_max[r] = _mm512_max_ps(wide_max[r], _mm512_loadu_ps(s + r * kChunk + j));
  }
  float m[R];
  __m512 shift[R];
  __m256 total[R];
  UNROLLED for (int r = 0; r < R; ++r) {
    m[r] = max_of(_mm256_max_ps(_mm512_castps512_ps256(wide_max[r]), _mm512_extractf32x8_ps(wide_max[r], 1)));
    shift[r] = _mm512_set1_ps(m[r]);
    total[r] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < kChunk; j += 32) {
    UNROLLED for (int r = 0; r < R; ++r) {
      const __m512 e0 = exp_nonpositive_16(_mm512_sub_ps(_mm512_loadu_ps(s + r * kChunk + j), shift[r]));
      const __m512 e1 = exp_nonpositive_16(_mm512_sub_ps(_mm512_loadu_ps(s + r * kChunk + j + 16), shift[r]));
      _mm512_storeu_si512(pairs + r * (kChunk / 2) + j / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      total[r] = _mm256_add_ps(total[r], _mm512_castps512_ps256(e0));
      total[r] = _mm256_add_ps(total[r], _mm512_extractf32x8_ps(e0, 1));
      total[r] = _mm256_add_ps(total[r], _mm512_castps512_ps256(e1));
      total[r] = _mm256_add_ps(total[r], _mm512_extractf32x8_ps(e1, 1));
    }
  }
  UNROLLED for (int r = 0; r < R; ++r) {
    partials[r * stride] = m[r];
    partials[r * stride + 1] = sum_of(total[r]);
  }
}

// A row's e (fp32, zero past `seen` up to a multiple of 8, in a kChunk buffer) as bf16 pairs
// (e_j, e_j+1), zero from its last pair up to pair `until`.
BF16DOT_TARGET void bf16_pairs(float* e, int64_t seen, int32_t* pairs, int64_t until) {
  const int64_t converted = (seen + 31) / 32 * 32;
  for (int64_t j = (seen + 7) / 8 * 8; j < converted; ++j) e[j] = 0.0f;
  for (int64_t j = 0; j < converted; j += 32) {
    const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(e + j + 16), _mm512_loadu_ps(e + j));
    _mm512_storeu_si512(pairs + j / 2, (__m512i)packed);
  }
  for (int64_t p = converted / 2; p < until; ++p) pairs[p] = 0;
}

// Key pair values (keys j and j + 1, zeros at or past `end`) interleaved: out[2g], out[2g + 1]
// hold dimensions 32g.. as (v_j, v_j+1) pairs, in unpack order (bf16_store_o puts them back).
template <int D>
BF16DOT_TARGET inline void interleaved_values(const at::BFloat16* values, int64_t j, int64_t end, __m512i* out) {
  for (int line = 0; line < 2 * D * 2; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(values + (j + kPrefetchKeys) * D) + line, _MM_HINT_T0);
  UNROLLED for (int g = 0; g < (D + 31) / 32; ++g) {
    const __mmask32 mask = 32 * g + 32 <= D ? 0xFFFFFFFFu : __mmask32((1u << (D - 32 * g)) - 1);
    const __m512i a = _mm512_maskz_loadu_epi16(mask, values + j * D + 32 * g);
    const __m512i b = j + 1 < end ? _mm512_maskz_loadu_epi16(mask, values + (j + 1) * D + 32 * g) : _mm512_setzero_si512();
    out[2 * g] = _mm512_unpacklo_epi16(a, b);
    out[2 * g + 1] = _mm512_unpackhi_epi16(a, b);
  }
}

// o of NR rows (e[r]: a row's bf16 pairs) over the pairs from key `begin` on, `pairs` of them,
// interleaving each pair's values in registers: one token's rows (a decode step) read them once.
template <int D, int NR>
BF16DOT_TARGET void bf16_values_direct(const int32_t* const* e, const at::BFloat16* values, int64_t begin, int64_t end,
                                       int64_t pairs, __m512* o_rows, const at::BFloat16* next_keys) {
  constexpr int V = Bf16Values<D>::kVectors;
  __m512 o[NR][V];
  UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int z = 0; z < V; ++z) o[r][z] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i v[V];
    if (next_keys != nullptr)  // the next chunk's keys into L2: a thread's next task is that chunk
      for (int line = 0; line < 2 * D * 2; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next_keys + 2 * p * D) + line, _MM_HINT_T1);
    interleaved_values<D>(values, begin + 2 * p, end, v);
    UNROLLED for (int z = 0; z < V; ++z)
      UNROLLED for (int r = 0; r < NR; ++r) o[r][z] = _mm512_dpbf16_ps(o[r][z], (__m512bh)_mm512_set1_epi32(e[r][p]), (__m512bh)v[z]);
  }
  UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int z = 0; z < V; ++z) _mm512_store_ps(o_rows + r * V + z, o[r][z]);
}

// o of NR rows (in memory, rows V vectors apart) += their pairs [p0, p1), whose interleaved values
// vbuf holds from p0 on: the groups of rows of several tokens share each block while it is in L1.
template <int D, int NR>
BF16DOT_TARGET void bf16_values_block(const int32_t* const* e, const __m512i* vbuf, int64_t p0, int64_t p1, __m512* o_rows) {
  constexpr int V = Bf16Values<D>::kVectors;
  __m512 o[NR][V];
  UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int z = 0; z < V; ++z) o[r][z] = _mm512_load_ps(o_rows + r * V + z);
  for (int64_t p = p0; p < p1; ++p) {
    UNROLLED for (int z = 0; z < V; ++z) {
      const __m512i v = _mm512_load_si512(vbuf + (p - p0) * V + z);
      UNROLLED for (int r = 0; r < NR; ++r) o[r][z] = _mm512_dpbf16_ps(o[r][z], (__m512bh)_mm512_set1_epi32(e[r][p]), (__m512bh)v);
    }
  }
  UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int z = 0; z < V; ++z) _mm512_store_ps(o_rows + r * V + z, o[r][z]);
}

// o in unpack order (per 32 dimensions: the low and the high 4 of each 128-bit lane's 8) -> the
// dimensions in order, into a partial's o.
template <int D>
BF16DOT_TARGET void bf16_store_o(const __m512* o, float* dest) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  UNROLLED for (int g = 0; g < (D + 31) / 32; ++g) {
    _mm512_storeu_ps(dest + 32 * g, _mm512_permutex2var_ps(o[2 * g], first, o[2 * g + 1]));
    if (32 * g + 16 < D) _mm512_storeu_ps(dest + 32 * g + 16, _mm512_permutex2var_ps(o[2 * g], second, o[2 * g + 1]));
  }
}

// ---- bf16 dot products for the scores (same CPUs, a bf16 cache and bf16 queries) ---------------
//
// Why: the scores as fp32 fmas cost each key D/8 fmas a row plus its conversion from bf16 and a
// reduction tree, most of a decode step's arithmetic at depth (bench/attention.py). model.py casts
// q to the cache's dtype, so q and k are both bf16 and vdpbf16ps multiplies them exactly, two
// dimensions a lane. A row's score for key k, computed the same way in every call:
//
//   lanes i = 0..15: a_i = vdpbf16ps chained from +0 over the key's 32-dimension vectors h in order,
//   lane i of vector h holding dimensions 32h + 2i, 32h + 2i + 1 (zeros past D);
//   s = ((((a0+a2)+(a1+a3)) + ((a4+a6)+(a5+a7))) + (((a8+a10)+(a9+a11)) + ((a12+a14)+(a13+a15)))) * scale
//
// (sixteen_sums computes that tree for 16 keys at once with shuffles). Keys are taken 16 at a time
// from the chunk's start; those at or past the call's last visible key are zeros, never read.
// Whether a call's scores take this sequence: bf16 values chosen, and q and the cache both bf16.
template <bool kBf16Values, typename QT, typename KT>
constexpr bool kBf16Scores = kBf16Values && std::is_same_v<QT, at::BFloat16> && std::is_same_v<KT, at::BFloat16>;

template <int D>
struct Bf16Scores {
  static constexpr int kVectors = (D + 31) / 32;  // 32-dimension vectors per key (and per query)
  static constexpr __mmask32 mask(int h) { return 32 * h + 32 <= D ? 0xFFFFFFFFu : __mmask32((1u << (D - 32 * h)) - 1); }
};

template <int D>
BF16DOT_TARGET inline void bf16_query(const at::BFloat16* q, __m512i* out) {
  UNROLLED for (int h = 0; h < Bf16Scores<D>::kVectors; ++h) out[h] = _mm512_maskz_loadu_epi16(Bf16Scores<D>::mask(h), q + 32 * h);
}

// Lane k = the tree of the header above over a[k]'s lanes, for 16 vectors at once.
BF16DOT_TARGET inline __m512 sixteen_sums(const __m512* a) {
  __m512 b[8], c[4];
  UNROLLED for (int k = 0; k < 8; ++k)  // per 128 bits: a0+a2, b0+b2, a1+a3, b1+b3
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  UNROLLED for (int k = 0; k < 4; ++k) {  // per 128 bits: the 4 keys' sums of those 4 lanes
    const __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// Scores of one row (q: its Bf16Scores vectors) for keys j0..j0+15, zeros at or past `end`.
template <int D>
BF16DOT_TARGET inline __m512 bf16_sixteen_scores(const __m512i* q, const at::BFloat16* keys, int64_t j0, int64_t end, float scale) {
  constexpr int H = Bf16Scores<D>::kVectors;
  __m512 acc[16];
  if (j0 + 16 <= end) {
    UNROLLED for (int k = 0; k < 16; ++k) {
      acc[k] = _mm512_setzero_ps();
      UNROLLED for (int h = 0; h < H; ++h)
        acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)q[h], (__m512bh)_mm512_maskz_loadu_epi16(Bf16Scores<D>::mask(h), keys + (j0 + k) * D + 32 * h));
    }
  } else {
    for (int k = 0; k < 16; ++k) {
      acc[k] = _mm512_setzero_ps();
      UNROLLED for (int h = 0; h < H; ++h) {
        const __m512i key = j0 + k < end ? _mm512_maskz_loadu_epi16(Bf16Scores<D>::mask(h), keys + (j0 + k) * D + 32 * h) : _mm512_setzero_si512();
        acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)q[h], (__m512bh)key);
      }
    }
  }
  return _mm512_mul_ps(sixteen_sums(acc), _mm512_set1_ps(scale));
}

// f(std::integral_constant<int, n>) for 1 <= n <= NR: the kernels above are unrolled over their rows.
template <int NR, typename F>
inline void with_rows(int n, F&& f) {
  if constexpr (NR > 1) {
    if (n < NR) return with_rows<NR - 1>(n, f);
  }
  f(std::integral_constant<int, NR>{});
}

// ---- AMX tiles for the scores (a bf16 cache and bf16 queries on CPUs with AMX-BF16) -----------
//
// Why: vdpbf16ps costs every row of a call the same work, so a 1+7-row verification paid 7x a decode
// row's scores and a prefill chunk deep in a prompt ran at half torch's speed (its flash kernel
// multiplies on tiles): this VM runs vdpbf16ps at 0.5 a cycle. One tdpbf16ps multiplies 16 keys by
// 32 dimensions of up to 16 rows. A row's score for key j, the same whatever the other rows:
//
//   c = +0; for each 32-dimension half h of the head in order: c = tdpbf16ps's element for (key j,
//   this row) over the half's 16 dimension pairs (the tile computes each element from its own key
//   row and query column only); s = c * scale.
//
// Keys are taken 16 at a time from the chunk's start (an A tile read straight from the cache, the
// block past `end` from a zero-padded copy); the rows' query pairs are the B tile. Head dims that are
// not a multiple of 32 take the vdpbf16ps sequence above.
#define AMX_BF16_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

bool amx_scores_available() {
  static const bool available = cpu_has_avx512_bf16() && __builtin_cpu_supports("amx-tile") &&
                                __builtin_cpu_supports("amx-bf16") && amx_available();
  return available;
}

// Whether a call over a bf16 cache with bf16 queries takes its scores from tiles:
// DFLASH_ATTENTION_ISA=avx512-bf16 (or =avx2) forces the vdpbf16ps (or fp32) sequence instead.
bool amx_scores_chosen() {
  const char* forced = std::getenv("DFLASH_ATTENTION_ISA");
  if (forced != nullptr && (std::strcmp(forced, "avx2") == 0 || std::strcmp(forced, "avx512-bf16") == 0)) return false;
  return amx_scores_available();
}

// Rows::amx for a call of head dim D whose bf16 cache takes bf16 values: tiles where chosen and the
// head is whole 32-dimension halves (else the vdpbf16ps sequence, for every row of that model).
bool amx_rows(bool bf16_values, int64_t D) { return bf16_values && D % 32 == 0 && amx_scores_chosen(); }

// Two sets of tiles, so that one block of 16 keys multiplies while the scores of the block before
// are gathered (a block's tile operations, then its gathers, one after the other kept the AMX unit
// and the vector unit waiting on each other: bench/attention.py, prefill 256 at 16K). Set s: tmm{3s}
// the sums, 16 keys x n rows (fp32), tmm{3s+1} 16 keys x 32 dimensions (bf16); tmm2 and tmm5: the n
// rows' dimensions 0-31 and 32-63 as 16 pairs x n rows, loaded once where the head has at most 64
// (tmm2 reloaded per half for a wider head).
AMX_BF16_TARGET void load_score_tiles(int n) {
  TileConfig config;
  for (int set = 0; set < 2; ++set) {
    config.shape(3 * set, 16, 4 * n);
    config.shape(3 * set + 1, 16, 64);
    config.shape(3 * set + 2, 16, 4 * n);
  }
  load_tiles(config);
}

// The sums of block `block` (16 keys from `keys_block`) into tile set `Set` and `sums`. The tile
// intrinsics paste their arguments into the instruction, so each set's tile numbers are literals:
// one body, written once as a macro, for tmm0 (sums) and tmm1 (keys) or tmm3 and tmm4.
#define SCORE_BLOCK_ON_TILES(SUMS, KEYS)                 \
  _tile_zero(SUMS);                                      \
  _tile_loadd(KEYS, keys_block, stride);                 \
  if constexpr (H > 2) _tile_loadd(2, pairs[0], 64);     \
  _tile_dpbf16ps(SUMS, KEYS, 2);                         \
  for (int h = 1; h < H; ++h) {                          \
    _tile_loadd(KEYS, keys_block + 32 * h, stride);      \
    if (H <= 2) {                                        \
      _tile_dpbf16ps(SUMS, KEYS, 5);                     \
    } else {                                             \
      _tile_loadd(2, pairs[h], 64);                      \
      _tile_dpbf16ps(SUMS, KEYS, 2);                     \
    }                                                    \
  }                                                      \
  _tile_stored(SUMS, sums, 64);

template <int D, int Set>
AMX_BF16_TARGET inline void score_block(const at::BFloat16* keys_block, const uint32_t (*pairs)[16][16], float* sums) {
  constexpr int H = D / 32;
  constexpr int64_t stride = D * sizeof(at::BFloat16);
  if constexpr (Set == 0) {
    SCORE_BLOCK_ON_TILES(0, 1)
  } else {
    SCORE_BLOCK_ON_TILES(3, 4)
  }
}
#undef SCORE_BLOCK_ON_TILES

// Block sums [key][row] of the keys from j0 -> each row's 16 scores (times `scale`) at out + r * kChunk.
// rows[r] = lane r of a[0..15] (a 16 x 16 transpose of 32-bit lanes): 4 rounds of shuffles, 64 instructions.
AVX512_TARGET inline void transpose16(const __m512* a, __m512* rows) {
  __m512 t[16], u[16];
  // t[2i], t[2i+1]: in each 128-bit lane L, vectors 2i and 2i+1's lanes 4L, 4L+1 and 4L+2, 4L+3
  UNROLLED for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  // u[4i+c]: in each 128-bit lane L, vectors 4i..4i+3's lane 4L+c
  UNROLLED for (int i = 0; i < 4; ++i) {
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  // lane 4L+c: 128-bit lane L of u[c], u[4+c], u[8+c], u[12+c], in that order
  UNROLLED for (int c = 0; c < 4; ++c) {
    const __m512 even_low = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), odd_low = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 even_high = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 odd_high = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    rows[c] = _mm512_shuffle_f32x4(even_low, even_high, 0x88);
    rows[8 + c] = _mm512_shuffle_f32x4(even_low, even_high, 0xDD);
    rows[4 + c] = _mm512_shuffle_f32x4(odd_low, odd_high, 0x88);
    rows[12 + c] = _mm512_shuffle_f32x4(odd_low, odd_high, 0xDD);
  }
}

// Block sums [key][row] of the keys from j0 -> each row's 16 scores (times `scale`) at out + r * kChunk.
// A transpose in registers: the 16 gathers it replaced, 16 loads each, were a fifth of a 256-token
// prefill chunk's attention at 16K (perf, AMX VM). The same values move, so the scores keep their bits.
AMX_BF16_TARGET inline void gather_scores(const float (*block_sums)[16], const int64_t* last, int n, int64_t j0, float scale,
                                          float* out) {
  __m512 a[16], rows[16];
  UNROLLED for (int k = 0; k < 16; ++k) a[k] = _mm512_load_ps(block_sums[k]);
  transpose16(a, rows);
  const __m512 scaled = _mm512_set1_ps(scale);
  UNROLLED for (int r = 0; r < 16; ++r) {
    if (r < n && last[r] >= j0) _mm512_storeu_ps(out + r * kChunk, _mm512_mul_ps(rows[r], scaled));
  }
}

// The scores of n <= 16 rows (q_rows[r], each seeing keys up to last[r]) for the keys of a chunk from
// `begin`, 16 at a time up to the last key any of them sees, keys at or past `end` zeros: into
// scores + r * kChunk from the chunk's first key on.
template <int D>
AMX_BF16_TARGET void amx_scores(const at::BFloat16* const* q_rows, const int64_t* last, int n, float scale, int64_t begin,
                                int64_t end, const at::BFloat16* keys, const at::BFloat16* values, float* scores) {
  static_assert(D % 32 == 0, "tiles take the head 32 dimensions at a time");
  constexpr int H = D / 32;
  alignas(64) uint32_t pairs[H][16][16];  // B tiles: [half][dimension pair][row]
  alignas(64) float sums[2][16][16] = {};  // [set][key][row] (rows past n: zeros the transpose moves)
  alignas(64) at::BFloat16 tail[16 * D];
  int64_t stop = begin;
  for (int r = 0; r < n; ++r) stop = std::max(stop, last[r] + 1);
  stop = std::min(stop, end);
  for (int h = 0; h < H; ++h)
    for (int k = 0; k < 16; ++k)
      for (int r = 0; r < n; ++r) std::memcpy(&pairs[h][k][r], q_rows[r] + 32 * h + 2 * k, 4);
  load_score_tiles(n);
  if constexpr (H <= 2) {
    _tile_loadd(2, pairs[0], 64);
    if constexpr (H == 2) _tile_loadd(5, pairs[1], 64);
  }
  auto block_keys = [&](int64_t j0) {  // keys j0.., the ones at or past `end` as zeros
    if (j0 + 16 <= end) return keys + j0 * D;
    std::memset(static_cast<void*>(tail), 0, sizeof(tail));
    std::memcpy(static_cast<void*>(tail), keys + j0 * D, sizeof(at::BFloat16) * D * (end - j0));
    return static_cast<const at::BFloat16*>(tail);
  };
  auto gather = [&](int64_t j0, const float (*block_sums)[16]) { gather_scores(block_sums, last, n, j0, scale, scores + (j0 - begin)); };
  int64_t block = 0;
  for (int64_t j0 = begin; j0 < stop; j0 += 16, ++block) {
    // Tile loads are not prefetched by the hardware at a decode row's pace (a cache at depth streams
    // from memory): the keys kPrefetchKeys ahead into L1, the values this block's into L2 for the
    // pass after the softmax.
    for (int64_t line = 0; line < 16 * D * 2; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(keys + (j0 + kPrefetchKeys) * D) + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(values + j0 * D) + line, _MM_HINT_T1);
    }
    if (block % 2 == 0) score_block<D, 0>(block_keys(j0), pairs, &sums[0][0][0]);
    else score_block<D, 1>(block_keys(j0), pairs, &sums[1][0][0]);
    if (block > 0) gather(j0 - 16, sums[(block - 1) % 2]);
  }
  if (block > 0) gather(begin + 16 * (block - 1), sums[(block - 1) % 2]);
  _tile_release();
}

// The scores of rows [first, last) of several tokens (a prefill task; positions[i - first]) over the
// chunk's keys [begin, end) on tiles with the operands turned: each group of 16 rows' queries is A
// and the chunk's keys are B, laid out as dimension pairs x keys once per call for all the groups,
// so the sums come out [row][key] and go straight into the rows' scores (kChunk apart), not yet times
// 1/sqrt(D): the softmax takes that multiply into its first pass (tokens_partials). amx_scores
// (keys as A) needs a transpose per group and block of keys, 12 of them a block for a task of 64
// tokens; this, one. tdpbf16ps adds each element's products in the order of the dimension pairs,
// whichever operand holds the rows, so every score keeps the bits amx_scores gives it (the
// prefill-vs-decode test holds them equal). Rows that do not see a block get scores no one reads.
// Heads of at most 64 dimensions (two A tiles); else amx_scores.
//
// TURNED_SCORE_BLOCK: block b of 16 keys with the operands turned (here and amx_int8_scores): the
// rows' A tiles (tmm2, tmm3 for a second part) times the block's PARTS laid-out key tiles into SUMS,
// stored kChunk apart from OUT + 16 * b (fp32 or int32 sums, 4 bytes each). DOT is the tile product;
// the tile intrinsics paste their arguments into the instruction, so the tile numbers are literals.
#define TURNED_SCORE_BLOCK(DOT, PARTS, OUT, SUMS, KEYS0, KEYS1) \
  _tile_zero(SUMS);                                             \
  _tile_loadd(KEYS0, laid + (b * PARTS) * 256, 64);             \
  DOT(SUMS, 2, KEYS0);                                          \
  if constexpr (PARTS == 2) {                                   \
    _tile_loadd(KEYS1, laid + (b * PARTS + 1) * 256, 64);       \
    DOT(SUMS, 3, KEYS1);                                        \
  }                                                             \
  _tile_stored(SUMS, OUT + 16 * b, kChunk * 4);

template <int D>
AMX_BF16_TARGET void amx_tokens_scores(const Rows<at::BFloat16>& rows, int64_t h, int64_t first, int64_t last,
                                       const int64_t* positions, int64_t begin, int64_t end, const at::BFloat16* keys,
                                       const at::BFloat16* values, float* all_scores) {
  static_assert(D == 32 || D == 64, "two A tiles hold a row's query");
  constexpr int H = D / 32;  // 32 dimensions (16 pairs) a tile
  const int64_t stop = std::min(end, positions[last - 1 - first] + 1);  // keys any row sees (position order)
  if (stop <= begin) return;
  const int64_t blocks = (stop - begin + 15) / 16;
  thread_local Scratch key_buffer;
  uint32_t* const laid = key_buffer.get<uint32_t>(size_t(blocks) * H * 256);  // [block][half][pair][key]
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = begin + 16 * b;
    for (int64_t line = 0; line < 16 * D * 2; line += 64)  // the values into L2 for the pass after the softmax
      _mm_prefetch(reinterpret_cast<const char*>(values + j0 * D) + line, _MM_HINT_T1);
    for (int half = 0; half < H; ++half) {
      __m512 key_pairs[16], pair_rows[16];  // key k's 16 dimension pairs -> pair p's 16 keys
      UNROLLED for (int k = 0; k < 16; ++k)
        key_pairs[k] = j0 + k < end ? _mm512_loadu_ps(keys + (j0 + k) * D + 32 * half) : _mm512_setzero_ps();
      transpose16(key_pairs, pair_rows);
      UNROLLED for (int p = 0; p < 16; ++p) _mm512_store_ps(laid + ((b * H + half) * 16 + p) * 16, pair_rows[p]);
    }
  }
  alignas(64) at::BFloat16 queries[16 * D];
  int configured = 0;  // rows the tiles are configured for: loading a configuration waits for every tile operation
  for (int64_t i0 = first; i0 < last; i0 += 16) {
    const int n = int(std::min<int64_t>(16, last - i0));
    const int64_t group_stop = std::min(end, positions[i0 + n - 1 - first] + 1);
    if (group_stop <= begin) continue;  // these rows see nothing of this chunk
    const int64_t group_blocks = (group_stop - begin + 15) / 16;
    for (int r = 0; r < n; ++r) std::memcpy(queries + r * D, rows.query(h, i0 + r), sizeof(at::BFloat16) * D);
    if (n != configured) {
      TileConfig config;  // tmm0, tmm1: sums (n rows x 16 keys); tmm2, tmm3: queries; tmm4-7: keys of two blocks
      for (int t = 0; t < 4; ++t) config.shape(t, n, 64);
      for (int t = 4; t < 8; ++t) config.shape(t, 16, 64);
      load_tiles(config);
      configured = n;
    }
    _tile_loadd(2, queries, D * sizeof(at::BFloat16));
    if constexpr (H == 2) _tile_loadd(3, queries + 32, D * sizeof(at::BFloat16));
    float* const out = all_scores + (i0 - first) * kChunk;
    for (int64_t b = 0; b < group_blocks; ++b) {
      if (b % 2 == 0) {
        TURNED_SCORE_BLOCK(_tile_dpbf16ps, H, out, 0, 4, 5)
      } else {
        TURNED_SCORE_BLOCK(_tile_dpbf16ps, H, out, 1, 6, 7)
      }
    }
  }
  _tile_release();
}

// The values on tiles too, where the scores are: o = sum over tdpbf16ps's blocks of 16 key pairs from
// the chunk's start, in order, from +0, each element computed from its own row's e pairs (e_j and
// e_j+1 as bf16, zero past its keys: bf16_pairs) and one dimension's value pairs (zeros at or past
// `end`). A row alone (fewer blocks) adds nothing but +0 or -0 to sums that are never -0, so it gets
// the same bits. 4 tiles of 16 dimensions at a time hold the sums; the value pairs of a block are
// laid out once for every row of the call.
AMX_BF16_TARGET void load_value_tiles(int n) {  // tmm0-3: sums, tmm4: e pairs (n rows), tmm5: value pairs
  TileConfig config;
  for (int t = 0; t < 5; ++t) config.shape(t, n, 64);
  config.shape(5, 16, 64);
  load_tiles(config);
}

template <int Tile>
AMX_BF16_TARGET inline void value_block(const at::BFloat16* pairs) {  // tmm{Tile} += tmm4 . pairs
  _tile_loadd(5, pairs, 64);
  // the tile intrinsics are macros that paste their arguments into the instruction: literal numbers
  if constexpr (Tile == 0) _tile_dpbf16ps(0, 4, 5);
  if constexpr (Tile == 1) _tile_dpbf16ps(1, 4, 5);
  if constexpr (Tile == 2) _tile_dpbf16ps(2, 4, 5);
  if constexpr (Tile == 3) _tile_dpbf16ps(3, 4, 5);
}

// The chunk's value pairs from `begin`, `pairs` of them (zeros at or past `end`), laid out for the
// tiles: block b of 16 pairs, 16 dimensions g at a time, at out + ((b * D / 16 + g) * 16 + k) * 32,
// (v_j, v_j+1) per dimension for pair k. Done once per chunk and call for all its groups of 16 rows
// (a prefill task's 48 rows are 3 groups, which each laid the same values out again before).
template <int D>
AMX_BF16_TARGET void amx_value_blocks(int64_t pairs, const at::BFloat16* values, int64_t begin, int64_t end, at::BFloat16* out) {
  constexpr int kGroups = D / 16;
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kInterleave);  // (a_d, b_d) for d < 16 of two 32-dimension vectors
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    at::BFloat16* block = out + (p0 / 16) * kGroups * 16 * 32;
    for (int k = 0; k < 16; ++k) {
      const int64_t j = begin + 2 * (p0 + k);
      for (int g = 0; g < kGroups; g += 2) {  // 32 dimensions of keys j, j + 1
        const __m512i a = j < end ? _mm512_loadu_si512(values + j * D + 16 * g) : _mm512_setzero_si512();
        const __m512i b = j + 1 < end ? _mm512_loadu_si512(values + (j + 1) * D + 16 * g) : _mm512_setzero_si512();
        _mm512_store_si512(block + (g * 16 + k) * 32, _mm512_permutex2var_epi16(a, low, b));
        if (g + 1 < kGroups) _mm512_store_si512(block + ((g + 1) * 16 + k) * 32, _mm512_permutex2var_epi16(a, high, b));
      }
    }
  }
}

// Rows r < n (<= 16; e + r * e_stride: their bf16 pairs, zero from their keys on up to the chunk's
// pairs rounded up to 16) over the chunk's key pairs, `pairs` of them, laid out by amx_value_blocks:
// o into their partials (out + r * (D + 2) + 2).
template <int D>
AMX_BF16_TARGET void amx_values(const int32_t* e, int64_t e_stride, int n, int64_t pairs, const at::BFloat16* blocks, float* out,
                                bool configured = false) {  // configured: load_value_tiles(n) done, released by the caller
  static_assert(D % 16 == 0, "tiles take the head 16 dimensions at a time");
  constexpr int kGroups = D / 16;
  if (!configured) load_value_tiles(n);
  for (int g0 = 0; g0 < kGroups; g0 += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const at::BFloat16* block = blocks + (p0 / 16) * kGroups * 16 * 32;
      _tile_loadd(4, e + p0, e_stride * sizeof(int32_t));
      value_block<0>(block + g0 * 16 * 32);
      if (g0 + 1 < kGroups) value_block<1>(block + (g0 + 1) * 16 * 32);
      if (g0 + 2 < kGroups) value_block<2>(block + (g0 + 2) * 16 * 32);
      if (g0 + 3 < kGroups) value_block<3>(block + (g0 + 3) * 16 * 32);
    }
    const int64_t stride = (D + 2) * sizeof(float);
    _tile_stored(0, out + 2 + 16 * g0, stride);
    if (g0 + 1 < kGroups) _tile_stored(1, out + 2 + 16 * (g0 + 1), stride);
    if (g0 + 2 < kGroups) _tile_stored(2, out + 2 + 16 * (g0 + 2), stride);
    if (g0 + 3 < kGroups) _tile_stored(3, out + 2 + 16 * (g0 + 3), stride);
  }
  if (!configured) _tile_release();
}

// The values of one token's n rows (their e in scores, kChunk apart, softmax done) over `seen` keys
// from `begin`, into their partials (D + 2 apart).
template <int D>
BF16DOT_TARGET void bf16_token_values(int n, float* scores, int64_t seen, int64_t begin, int64_t end,
                                      const at::BFloat16* values, float* out, const at::BFloat16* next_keys = nullptr,
                                      bool amx = false) {
  constexpr int V = Bf16Values<D>::kVectors;
  alignas(64) int32_t pairs[kTokenRows][kChunk / 2];
  alignas(64) __m512 o[kTokenRows * V];
  const int32_t* e[kTokenRows];
  const int64_t count = (seen + 1) / 2;
  for (int r = 0; r < n; ++r) {
    bf16_pairs(scores + r * kChunk, seen, pairs[r], amx ? (count + 15) / 16 * 16 : count);
    e[r] = pairs[r];
  }
  if constexpr (D % 16 == 0) {
    if (amx) {
      thread_local Scratch block_buffer;  // the chunk's pairs (rounded up to 16) for the tiles
      at::BFloat16* const blocks = block_buffer.get<at::BFloat16>(size_t(kChunk) * D);
      amx_value_blocks<D>(count, values, begin, end, blocks);
      return amx_values<D>(pairs[0], kChunk / 2, n, count, blocks, out);
    }
  }
  with_rows<kTokenRows>(n, [&](auto k) { bf16_values_direct<D, decltype(k)::value>(e, values, begin, end, count, o, next_keys); });
  for (int r = 0; r < n; ++r) bf16_store_o<D>(o + r * V, out + r * (D + 2) + 2);
}

// The values of rows [first, last) of several tokens (positions[i - first]; their e in scores, kChunk
// apart, softmax done) over the chunk's keys [begin, end), into their partials (D + 2 apart): blocks
// of interleaved pairs shared by groups of rows, each row's o in memory between blocks.
template <int D>
BF16DOT_TARGET void bf16_tokens_values(int64_t count, const int64_t* positions, float* scores, int64_t begin, int64_t end,
                                       const at::BFloat16* values, float* out, bool amx, int32_t* e, const bool* paired) {
  constexpr int V = Bf16Values<D>::kVectors, NR = Bf16Values<D>::kRows;
  constexpr int64_t kPairBlock = 16;
  thread_local Scratch o_buffer, block_buffer;
  const int64_t pairs = (end - begin + 1) / 2;
  if constexpr (D % 16 == 0) {
    if (amx) {
      int64_t active = 0;  // rows before it see nothing of this chunk (rows are in position order)
      while (active < count && positions[active] < begin) ++active;
      for (int64_t i = active; i < count; ++i) {
        if (!paired[i])
          bf16_pairs(scores + i * kChunk, std::min(end, positions[i] + 1) - begin, e + i * kChunk / 2, (pairs + 15) / 16 * 16);
      }
      at::BFloat16* const blocks = block_buffer.get<at::BFloat16>(size_t(kChunk) * D);  // 16-pair blocks
      amx_value_blocks<D>(pairs, values, begin, end, blocks);
      int configured = 0;  // loading a tile configuration waits for every tile operation: once per row count
      for (int64_t i = active; i < count; i += 16) {
        const int n = int(std::min<int64_t>(16, count - i));
        if (n != configured) load_value_tiles(configured = n);
        amx_values<D>(e + i * kChunk / 2, kChunk / 2, n, pairs, blocks, out + i * (D + 2), true);
      }
      if (configured) release_tiles();
      return;
    }
  }
  __m512* const o = o_buffer.get<__m512>(size_t(count) * V);
  __m512i* const vbuf = block_buffer.get<__m512i>(size_t(kPairBlock) * V);
  int64_t active = 0;  // rows before it see nothing of this chunk (rows are in position order)
  while (active < count && positions[active] < begin) ++active;
  for (int64_t i = active; i < count; ++i) {
    if (!paired[i]) bf16_pairs(scores + i * kChunk, std::min(end, positions[i] + 1) - begin, e + i * kChunk / 2, pairs);
  }
  std::memset(static_cast<void*>(o + active * V), 0, sizeof(__m512) * V * (count - active));
  const int32_t* rows_e[NR];
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairBlock) {
    const int64_t p1 = std::min(pairs, p0 + kPairBlock);
    for (int64_t p = p0; p < p1; ++p) interleaved_values<D>(values, begin + 2 * p, end, vbuf + (p - p0) * V);
    for (int64_t i = active; i < count; i += NR) {
      const int n = int(std::min<int64_t>(NR, count - i));
      const int64_t until = std::min(p1, (std::min(end, positions[i + n - 1] + 1) - begin + 1) / 2);  // its last row's pairs
      if (until <= p0) continue;
      for (int r = 0; r < n; ++r) rows_e[r] = e + (i + r) * kChunk / 2;
      with_rows<NR>(n, [&](auto k) { bf16_values_block<D, decltype(k)::value>(rows_e, vbuf, p0, until, o + i * V); });
    }
  }
  for (int64_t i = active; i < count; ++i) bf16_store_o<D>(o + i * V, out + i * (D + 2) + 2);
}

// bf16_token_values after bf16 dot-product scores: the partials of NR rows of one token over the
// chunk's `seen` keys from `begin` (keys at or past `end` are zeros), each key vector loaded from
// memory once for the NR rows (they stay in L1 for the next rows).
template <int D, int NR>
BF16DOT_TARGET void bf16_token_partials(const at::BFloat16* const* q_rows, float scale, int64_t seen, int64_t begin, int64_t end,
                                        const at::BFloat16* keys, const at::BFloat16* values, float* scores, float* out,
                                        bool amx) {
  if constexpr (D % 32 == 0) {
    if (amx) {
      int64_t last[NR];
      for (int r = 0; r < NR; ++r) last[r] = begin + seen - 1;
      amx_scores<D>(q_rows, last, NR, scale, begin, end, keys, values, scores);
    }
  }
  __m512i q[NR][Bf16Scores<D>::kVectors];
  UNROLLED for (int r = 0; r < NR && !amx; ++r) bf16_query<D>(q_rows[r], q[r]);
  for (int64_t j0 = begin; j0 < begin + seen && !amx; j0 += 16) {
    for (int64_t line = 0; line < 16 * D * 2; line += 64) {  // values into L2 for the pass after the scores
      _mm_prefetch(reinterpret_cast<const char*>(keys + (j0 + kPrefetchKeys) * D) + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(values + j0 * D) + line, _MM_HINT_T1);
    }
    UNROLLED for (int r = 0; r < NR; ++r)
      _mm512_storeu_ps(scores + r * kChunk + (j0 - begin), bf16_sixteen_scores<D>(q[r], keys, j0, end, scale));
  }
  for (int r = 0; r < NR; ++r) chunk_softmax(scores + r * kChunk, seen, Partial{out + r * (D + 2)});
  bf16_token_values<D>(NR, scores, seen, begin, end, values, out, keys + (begin + kChunk) * D, amx);
}

// The scores of rows [first, last) of several tokens (positions[i - first]) over the chunk's keys
// [begin, end), into their rows of all_scores (kChunk apart): each block of 16 keys read from
// memory once for every row that sees it, each score the same bits as bf16_token_partials'.
template <int D>
BF16DOT_TARGET bool bf16_tokens_scores(const Rows<at::BFloat16>& rows, int64_t h, int64_t first, int64_t last, const int64_t* positions,
                                       int64_t begin, int64_t end, const at::BFloat16* keys, const at::BFloat16* values,
                                       float* all_scores) {  // true: the sums are left unscaled (amx_tokens_scores)
  constexpr int H = Bf16Scores<D>::kVectors;
  if constexpr (D == 32 || D == 64) {
    if (rows.amx) {
      amx_tokens_scores<D>(rows, h, first, last, positions, begin, end, keys, values, all_scores);
      return true;
    }
  }
  if constexpr (D % 32 == 0) {
    if (rows.amx) {
      for (int64_t i0 = first; i0 < last; i0 += 16) {  // 16 rows a tile
        const int n = int(std::min<int64_t>(16, last - i0));
        const at::BFloat16* q_rows[16];
        for (int r = 0; r < n; ++r) q_rows[r] = rows.query(h, i0 + r);
        amx_scores<D>(q_rows, positions + (i0 - first), n, rows.scale, begin, end, keys, values, all_scores + (i0 - first) * kChunk);
      }
      return false;
    }
  }
  thread_local Scratch query_buffer;
  __m512i* const q = query_buffer.get<__m512i>(size_t(last - first) * H);
  for (int64_t i = first; i < last; ++i) bf16_query<D>(rows.query(h, i), q + (i - first) * H);
  for (int64_t j0 = begin; j0 < end; j0 += 16) {
    for (int64_t i = first; i < last; ++i) {
      if (positions[i - first] < j0) continue;
      _mm512_storeu_ps(all_scores + (i - first) * kChunk + (j0 - begin), bf16_sixteen_scores<D>(q + (i - first) * H, keys, j0, end, rows.scale));
    }
  }
  return false;
}

// Partials of NR rows of one token (same position) over keys [begin, end) of a chunk: scores for
// keys begin.. in groups of 4 (keys at or past `end` read as zeros; scores past a row's position
// are masked below), the softmax, then the values. Each key and value vector is loaded (and
// converted from bf16) once for the NR rows; every row's arithmetic is the fixed sequence of
// the header comment whatever NR is: accumulations over D blocks in order, one tree per score,
// values added in key order.
template <int D, int NR, bool kBf16Values, typename KT>
AVX2_TARGET void token_partials(const float* queries, float scale, int64_t seen, int64_t begin, int64_t end,
                                const KT* keys, const KT* values, float* scores, float* out) {
  constexpr int blocks = D / 8;
  const int64_t stop = begin + seen;  // keys these rows see
  for (int64_t j0 = begin; j0 < stop; j0 += 4) {
    __m256 acc[NR][4];
    UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int k = 0; k < 4; ++k) acc[r][k] = _mm256_setzero_ps();
    if (j0 + 4 <= end) {
      // the hardware prefetcher falls behind a stream read at this pace (measured: 4 GB/s of keys)
      for (int64_t line = 0; line < 4 * D * int64_t(sizeof(KT)); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(keys + (j0 + kPrefetchKeys) * D) + line, _MM_HINT_T0);
      UNROLLED for (int b = 0; b < blocks; ++b) {
        __m256 q[NR];
        UNROLLED for (int r = 0; r < NR; ++r) q[r] = _mm256_loadu_ps(queries + r * D + 8 * b);
        UNROLLED for (int k = 0; k < 4; ++k) {
          const __m256 key = load8(keys + (j0 + k) * D + 8 * b);
          UNROLLED for (int r = 0; r < NR; ++r) acc[r][k] = _mm256_fmadd_ps(q[r], key, acc[r][k]);
        }
      }
    } else {  // the chunk's last keys: those at or past `end` are zeros (never read)
      UNROLLED for (int b = 0; b < blocks; ++b) {
        __m256 q[NR];
        UNROLLED for (int r = 0; r < NR; ++r) q[r] = _mm256_loadu_ps(queries + r * D + 8 * b);
        for (int k = 0; k < 4; ++k) {
          const __m256 key = j0 + k < end ? load8(keys + (j0 + k) * D + 8 * b) : _mm256_setzero_ps();
          UNROLLED for (int r = 0; r < NR; ++r) acc[r][k] = _mm256_fmadd_ps(q[r], key, acc[r][k]);
        }
      }
    }
    UNROLLED for (int r = 0; r < NR; ++r)
      _mm_storeu_ps(scores + r * kChunk + (j0 - begin), _mm_mul_ps(sums_of_four(acc[r]), _mm_set1_ps(scale)));
  }
  for (int r = 0; r < NR; ++r) chunk_softmax(scores + r * kChunk, seen, Partial{out + r * (D + 2)});
  if constexpr (kBf16Values) {
    return bf16_token_values<D>(NR, scores, seen, begin, end, values, out);
  }
  // o = sum over visible keys, in key order, of e_j v_j: a slice of up to 4 vectors of D at a time
  constexpr int slice = blocks < 4 ? blocks : 4;
  for (int b0 = 0; b0 < blocks; b0 += slice) {
    __m256 o[NR][slice];
    UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int b = 0; b < slice; ++b) o[r][b] = _mm256_setzero_ps();
    for (int64_t j = 0; j < seen; ++j) {
      if (b0 == 0 && (j * D * int64_t(sizeof(KT))) % 64 == 0) {
        for (int64_t line = 0; line < D * int64_t(sizeof(KT)); line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(values + (begin + j + kPrefetchKeys) * D) + line, _MM_HINT_T0);
      }
      __m256 value[slice];
      UNROLLED for (int b = 0; b < slice; ++b) value[b] = load8(values + (begin + j) * D + 8 * (b0 + b));
      UNROLLED for (int r = 0; r < NR; ++r) {
        const __m256 e = _mm256_set1_ps(scores[r * kChunk + j]);
        UNROLLED for (int b = 0; b < slice; ++b) o[r][b] = _mm256_fmadd_ps(e, value[b], o[r][b]);
      }
    }
    UNROLLED for (int r = 0; r < NR; ++r)
      UNROLLED for (int b = 0; b < slice; ++b) _mm256_storeu_ps(out + r * (D + 2) + 2 + 8 * (b0 + b), o[r][b]);
  }
}

// s[0..seen) *= scale, each score as gather_scores multiplies it (amx_tokens_scores' sums).
AVX2_TARGET inline void scale_scores(float* s, int64_t seen, float scale) {
  const __m256 scaled = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= seen; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), scaled));
  for (; j < seen; ++j) s[j] *= scale;
}

// Partials of rows [first, last) of KV head h over chunk c when they are several tokens (a
// verification, a prefill task): each block of 8 keys converted once for all rows (rows whose
// position is below the chunk are left alone). keys/values: [L, D] of this head.
template <int D, bool kBf16Values, typename QT, typename KT>
AVX2_TARGET void tokens_partials(const Rows<QT>& rows, int64_t h, int64_t first, int64_t last, int64_t c,
                                const KT* keys, const KT* values, int64_t L, float* out) {  // out: row first's partial
  constexpr int blocks = D / 8;
  const int64_t begin = c * kChunk;
  const int64_t end = std::min(begin + kChunk, rows.position(last - 1) + 1);  // keys any row here sees
  alignas(32) float key_block[8 * D];
  const int64_t count = last - first;
  // this chunk's values as fp32 (read by every row), each row's scores, its query as fp32, and its
  // position (computed once here: i / G in the inner loops cost more than the scores' arithmetic)
  std::unique_ptr<float[]> scratch(new float[kChunk * D + count * kChunk + count * D]);
  float* const value_chunk = scratch.get();
  float* const all_scores = value_chunk + kChunk * D;
  float* const queries = all_scores + count * kChunk;
  std::unique_ptr<int64_t[]> positions(new int64_t[count]);
  for (int64_t i = first; i < last; ++i) {
    positions[i - first] = rows.position(i);
    if constexpr (kBf16Scores<kBf16Values, QT, KT>) continue;  // bf16_tokens_scores reads q as it is
    const QT* q = rows.query(h, i);
    UNROLLED for (int b = 0; b < blocks; ++b) _mm256_storeu_ps(queries + (i - first) * D + 8 * b, load8(q + 8 * b));
  }
  bool unscaled = false;  // amx_tokens_scores leaves 1/sqrt(D) to the softmax's first pass
  if constexpr (kBf16Scores<kBf16Values, QT, KT>)
    unscaled = bf16_tokens_scores<D>(rows, h, first, last, positions.get(), begin, end, keys, values, all_scores);
  // scores, 8 keys at a time; the block past the cache's end reads zero-padded copies
  for (int64_t j0 = begin; j0 < end && !kBf16Scores<kBf16Values, QT, KT>; j0 += 8) {
    UNROLLED for (int k = 0; k < 8; ++k) {
      const int64_t j = j0 + k;
      if (j < L) {
        UNROLLED for (int b = 0; b < blocks; ++b) _mm256_store_ps(key_block + k * D + 8 * b, load8(keys + j * D + 8 * b));
      } else {
        std::memset(key_block + k * D, 0, sizeof(float) * D);
      }
      if (!kBf16Values && j < end) {
        UNROLLED for (int b = 0; b < blocks; ++b) _mm256_storeu_ps(value_chunk + (j - begin) * D + 8 * b, load8(values + j * D + 8 * b));
      }
    }
    for (int64_t i = first; i < last; ++i) {
      if (positions[i - first] < j0) continue;
      const float* q = queries + (i - first) * D;
      __m256 acc[8];
      UNROLLED for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
      UNROLLED for (int b = 0; b < blocks; ++b) {
        __m256 qb = _mm256_loadu_ps(q + 8 * b);
        UNROLLED for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qb, _mm256_load_ps(key_block + k * D + 8 * b), acc[k]);
      }
      _mm256_storeu_ps(all_scores + (i - first) * kChunk + (j0 - begin),
                       _mm256_mul_ps(sums_of_eight(acc), _mm256_set1_ps(rows.scale)));
    }
  }
  // softmax over each row's visible keys of this chunk, then its values; with bf16 values, rows that
  // see the whole chunk four at a time, their e straight into bf16 pairs (paired)
  thread_local Scratch pair_buffer, paired_buffer;
  int32_t* const e_pairs = kBf16Values ? pair_buffer.get<int32_t>(size_t(count) * kChunk / 2) : nullptr;
  bool* const paired = kBf16Values ? paired_buffer.get<bool>(size_t(count)) : nullptr;
  if (kBf16Values) std::fill(paired, paired + count, false);
  for (int64_t i = first; i < last; ++i) {
    const int64_t seen = std::min(end, positions[i - first] + 1) - begin;  // keys of this chunk row i sees
    if (seen <= 0) continue;
    float* s = all_scores + (i - first) * kChunk;
    const Partial p{out + (i - first) * (D + 2)};
    if (kBf16Values && seen == kChunk && i + 4 <= last && chunk_softmax_wide()) {  // and the 3 rows after it (position order)
      chunk_softmax_avx512_four_whole(s, p.p, D + 2, e_pairs + (i - first) * kChunk / 2, unscaled ? rows.scale : 1.0f);
      std::fill(paired + (i - first), paired + (i - first) + 4, true);
      i += 3;
      continue;
    }
    if (unscaled) scale_scores(s, seen, rows.scale);
    chunk_softmax(s, seen, p);
    if constexpr (kBf16Values) continue;
    __m256 o[blocks];
    UNROLLED for (int b = 0; b < blocks; ++b) o[b] = _mm256_setzero_ps();
    for (int64_t j = 0; j < seen; ++j) {
      const __m256 e = _mm256_set1_ps(s[j]);
      const float* v = value_chunk + j * D;
      UNROLLED for (int b = 0; b < blocks; ++b) o[b] = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 8 * b), o[b]);
    }
    UNROLLED for (int b = 0; b < blocks; ++b) _mm256_storeu_ps(p.o() + 8 * b, o[b]);
  }
  if constexpr (kBf16Values) {
    bf16_tokens_values<D>(count, positions.get(), all_scores, begin, end, values, out,
                          kBf16Scores<kBf16Values, QT, KT> && rows.amx, e_pairs, paired);
  }
}

// Partials of rows [first, last) of KV head h over chunk c (rows whose position is below the chunk
// are left alone); first and last are token boundaries (multiples of G). keys/values: [L, D] of
// this head; out: row first's partial, then the next rows'. One token's rows (a decode step) read
// the cache once, with prefetch (token_partials); several tokens' rows convert each block of keys
// once for all of them (tokens_partials; measured faster there). Both compute the same bits.
template <int D, bool kBf16Values, typename QT, typename KT>
AVX2_TARGET void chunk_partials(const Rows<QT>& rows, int64_t h, int64_t first, int64_t last, int64_t c,
                                const KT* keys, const KT* values, int64_t L, float* out) {
  if (rows.position(first) != rows.position(last - 1)) {
    tokens_partials<D, kBf16Values>(rows, h, first, last, c, keys, values, L, out);
    return;
  }
  constexpr int blocks = D / 8;
  const int64_t begin = c * kChunk;
  const int64_t end = std::min({begin + kChunk, rows.position(last - 1) + 1, L});  // keys any row here sees
  alignas(32) float queries[kTokenRows * D];
  alignas(32) float scores[kTokenRows * kChunk];
  for (int64_t i = first; i < last;) {
    const int64_t token_end = (i / rows.G + 1) * rows.G;  // rows of this token: [i, token_end)
    const int64_t n = std::min<int64_t>({kTokenRows, token_end - i, last - i});
    const int64_t seen = std::min(end, rows.position(i) + 1) - begin;  // keys of this chunk these rows see
    if (seen > 0) {
      for (int64_t r = 0; r < n && !kBf16Scores<kBf16Values, QT, KT>; ++r) {
        const QT* q = rows.query(h, i + r);
        UNROLLED for (int b = 0; b < blocks; ++b) _mm256_store_ps(queries + r * D + 8 * b, load8(q + 8 * b));
      }
      float* partial = out + (i - first) * (D + 2);
      if constexpr (kBf16Scores<kBf16Values, QT, KT>) {
        const at::BFloat16* q_rows[kTokenRows];
        for (int64_t r = 0; r < n; ++r) q_rows[r] = rows.query(h, i + r);
        with_rows<kTokenRows>(int(n), [&](auto k) {
          bf16_token_partials<D, decltype(k)::value>(q_rows, rows.scale, seen, begin, end, keys, values, scores, partial, rows.amx);
        });
      } else {
        switch (n) {
          case 3: token_partials<D, 3, kBf16Values>(queries, rows.scale, seen, begin, end, keys, values, scores, partial); break;
          case 2: token_partials<D, 2, kBf16Values>(queries, rows.scale, seen, begin, end, keys, values, scores, partial); break;
          default: token_partials<D, 1, kBf16Values>(queries, rows.scale, seen, begin, end, keys, values, scores, partial);
        }
      }
    }
    i += n;
  }
}

// state <- state merged with the next chunk's partial; never inlined, so every caller runs the same
// instructions (gcc may contract a * b + c into an fma differently in different inlined copies).
__attribute__((noinline)) AVX2_TARGET void merge(const Partial& state, const Partial& next, int64_t D) {
  const float m = std::max(state.m(), next.m());
  const __m256 a = exp_nonpositive(_mm256_set1_ps(state.m() - m)), b = exp_nonpositive(_mm256_set1_ps(next.m() - m));
  __m256 l = _mm256_fmadd_ps(_mm256_set1_ps(next.l()), b, _mm256_mul_ps(_mm256_set1_ps(state.l()), a));
  state.l() = _mm256_cvtss_f32(l);
  state.m() = m;
  for (int64_t d = 0; d < D; d += 8) {
    __m256 merged = _mm256_fmadd_ps(_mm256_loadu_ps(next.o() + d), b, _mm256_mul_ps(_mm256_loadu_ps(state.o() + d), a));
    _mm256_storeu_ps(state.o() + d, merged);
  }
}

template <typename OT>
AVX2_TARGET void finish(const Partial& state, OT* out, int64_t D) {
  const __m256 inverse = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(state.l()));
  alignas(32) float row[kMaxDim];
  for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(row + d, _mm256_mul_ps(_mm256_loadu_ps(state.o() + d), inverse));
  for (int64_t d = 0; d < D; ++d) out[d] = OT(row[d]);
}

// Runs task(h, first, last, c) for rows [first, last) of every KV head h over every chunk c below
// `chunks`, in chunk order. Few (head, chunk) pairs leave threads idle (a short context: 3 KV heads'
// one full chunk over 2 threads ran 2:1), so the rows are split too, into parts enough for ~4 tasks
// a thread; a row's partial is the same whatever rows share its task.
template <typename Task>
void few_rows_tasks(int64_t KV, int64_t chunks, int64_t R, Task&& task, bool worth_waking) {
  const int64_t threads = at::get_num_threads();
  const int64_t parts = threads < 2 ? 1 : std::clamp<int64_t>((4 * threads + KV * chunks - 1) / (KV * chunks), 1, R);
  step_pool::parallel_tasks(KV * chunks * parts, [&](int64_t i) {
    const int64_t c = i / (KV * parts), h = i / parts % KV, part = i % parts;
    const int64_t first = part * R / parts, last = (part + 1) * R / parts;
    if (first < last) task(h, first, last, c);
  }, worth_waking);
}

// Runs partials(h, first, last, c, into) (rows [first, last) of KV head h over chunk c, into their
// partials D + 2 apart) for every head and chunk, merges each row's partials in chunk order and
// writes out. Few rows: one task per (head, chunk); many: one per (head, block of tokens).
template <int D, typename QT, typename OT, typename Partials>
void schedule(const Rows<QT>& rows, int64_t KV, OT* out, Partials&& partials) {
  const int64_t R = rows.count(), S = D + 2, chunks = (rows.position(R - 1) + kChunk) / kChunk;
  auto output_row = [&](int64_t h, int64_t i) { return out + ((i / rows.G) * rows.H + h * rows.G + i % rows.G) * D; };
  // multiply-adds of the scores and the weighted values (rows attend to up to their position)
  const bool worth_waking = 2 * KV * R * (rows.position(R - 1) + 1) * D >= step_pool::kWorthWakingMacs;
  if (R <= kFewRows) {  // every (head, chunk, part of the rows) a task, then merge per row in chunk order
    auto buffer = partial_buffer(KV * chunks * R, D);
    // Full chunks first, each task claimed on its own: the last chunk is the short one.
    few_rows_tasks(KV, chunks, R, [&](int64_t h, int64_t first, int64_t last, int64_t c) {
      partials(h, first, last, c, buffer.get() + ((h * chunks + c) * R + first) * S);
    }, worth_waking);
    step_pool::parallel_for(KV * R, 1, [&](int64_t begin, int64_t end) {
      auto state_buffer = partial_buffer(1, D);
      const Partial state{state_buffer.get()};
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / R, i = task % R, last_chunk = rows.position(i) / kChunk;
        std::memcpy(state.p, buffer.get() + ((h * chunks) * R + i) * S, sizeof(float) * S);
        for (int64_t c = 1; c <= last_chunk; ++c) merge(state, Partial{buffer.get() + ((h * chunks + c) * R + i) * S}, D);
        finish(state, output_row(h, i), D);
      }
    }, worth_waking);
    return;
  }
  const int64_t per_task = kTokensPerTask * rows.G, blocks = (R + per_task - 1) / per_task;
  step_pool::parallel_for(KV * blocks, 1, [&](int64_t begin, int64_t end) {
    auto states = partial_buffer(per_task, D), next = partial_buffer(per_task, D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, first = (task % blocks) * per_task, last = std::min(R, first + per_task);
      const int64_t last_chunk = rows.position(last - 1) / kChunk;
      partials(h, first, last, 0, states.get());
      for (int64_t c = 1; c <= last_chunk; ++c) {
        partials(h, first, last, c, next.get());
        for (int64_t i = first; i < last; ++i) {
          if (rows.position(i) / kChunk >= c) merge(Partial{states.get() + (i - first) * S}, Partial{next.get() + (i - first) * S}, D);
        }
      }
      for (int64_t i = first; i < last; ++i) finish(Partial{states.get() + (i - first) * S}, output_row(h, i), D);
    }
  }, worth_waking);
}

template <int D, typename QT, typename KT>
void attend(const Rows<QT>& rows, const KT* keys, const KT* values, int64_t head_stride, int64_t L, int64_t KV, KT* out,
            bool bf16_values) {
  // the partials of rows [first, last) of head h over chunk c, by the values' sequence this call takes
  schedule<D>(rows, KV, out, [&](int64_t h, int64_t first, int64_t last, int64_t c, float* into) {
    const KT *head_keys = keys + h * head_stride, *head_values = values + h * head_stride;
    if constexpr (std::is_same_v<KT, at::BFloat16>) {
      if (bf16_values) return chunk_partials<D, true>(rows, h, first, last, c, head_keys, head_values, L, into);
    }
    chunk_partials<D, false>(rows, h, first, last, c, head_keys, head_values, L, into);
  });
}

// ---- int8 keys and values (AVX512-VNNI: AMD Zen 4, Intel from Ice Lake on) ---------------------
//
// Why: at depth a decode step reads every cached key and value once, so at 16K of context the
// cache is most of a step's memory traffic (bench/attention.py, "30 caches": memory-bound). As int8
// codes with one scale per (token, KV head) it is half the bytes of bf16, and VNNI multiplies the
// codes as integers (perplexity: README, Numbers). quantize_row is the one quantization (keys,
// values, each query row): scale = max|x| / 127, codes round-half-even(x / scale), all 0 where
// max|x| is 0. A row's partial over a chunk, computed the same way whatever the other rows of its
// call (integer sums are exact in any order; the float steps are per row, in a fixed order):
//
//   scores: the row's codes (signed) against each key's codes stored + 128 (unsigned, as vpdpbusd
//   takes them), minus 128 * the sum of the row's codes; s_j = (float(dot_j) * key_scale_j) *
//   (q_scale / sqrt(D)). chunk_softmax as above gives e_j, m and l.
//   values: w_j = e_j * value_scale_j (zero past the row's keys); f = max w / 32767, weights
//   round-half-even(w_j * (32767 / max w)) as int16 (0 where max w is 0); o = float(sum over key
//   pairs of vpdpwssd(weights, value codes)) * f. A weight is off by at most f / 2: finer than the
//   bf16 path's rounding of e_j for all but the smallest weights.
#define VNNI_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

constexpr int kKeyOffset = 128;        // a key code c is stored as the byte c + 128
constexpr float kWeightCodes = 32767;  // the largest value weight, as int16

// 16 values as fp32 (bf16's exactly: fp32's top half).
template <typename T>
VNNI_TARGET inline __m512 sixteen_floats(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
  }
}

// x[0..D) -> codes, returning the scale (quantize_kv, the query rows). Each code is one IEEE
// division and a round to nearest even (no fast-math), 16 lanes at a time (D is a multiple of 16):
// the bits of the scalar std::nearbyint(x / scale) clamped to +-127 that it replaced, NaN included
// (a NaN x is left out of the largest |x| and codes as 127, as std::max/std::min had it).
template <typename T>
VNNI_TARGET float quantize_row(const T* x, int64_t D, int8_t* codes) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) largest = _mm512_max_ps(_mm512_abs_ps(sixteen_floats(x + d)), largest);
  const float amax = _mm512_reduce_max_ps(largest);
  if (!(amax > 0.0f)) {
    std::memset(codes, 0, size_t(D));
    return 0.0f;
  }
  const float scale = amax / 127.0f;
  const __m512 divisor = _mm512_set1_ps(scale), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(sixteen_floats(x + d), divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 clamped = _mm512_max_ps(_mm512_min_ps(rounded, top), bottom);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
  }
  return scale;
}

// Query rows quantized once per call: codes [T, H, D] (as Rows), per row its scale times
// 1/sqrt(D) and 128 times its codes' sum (the unsigned keys' offset, taken back); `tiles`: whether
// the call's chunks of many rows take AMX tiles (amx_int8_scores_chosen, read once per call).
struct Int8Rows {
  Rows<int8_t> rows;
  const float* scales;
  const int32_t* offsets;
  bool tiles;
  int64_t index(int64_t h, int64_t i) const { return (i / rows.G) * rows.H + h * rows.G + i % rows.G; }
};

template <int D>
struct Int8Keys {
  static constexpr int kVectors = (D + 63) / 64;  // 64-byte vectors per key (and per query row)
  static constexpr __mmask64 mask(int h) { return 64 * h + 64 <= D ? ~__mmask64(0) : (__mmask64(1) << (D - 64 * h)) - 1; }
};

// Lane k = the sum of a[k]'s 16 lanes, for 16 vectors at once (integers: any tree gives the same).
VNNI_TARGET inline __m512i sixteen_int_sums(const __m512i* a) {
  __m512i b[8], c[4];
  UNROLLED for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_epi32(a[2 * k], a[2 * k + 1]));
  UNROLLED for (int k = 0; k < 4; ++k)
    c[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * k], b[2 * k + 1]), _mm512_unpackhi_epi64(b[2 * k], b[2 * k + 1]));
  const __m512i d0 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88), _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
  const __m512i d1 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], 0x88), _mm512_shuffle_i32x4(c[2], c[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(d0, d1, 0x88), _mm512_shuffle_i32x4(d0, d1, 0xDD));
}

// A row's scores from its integer sums over 16 keys: (float(dot - offset) * key_scale) * row_scale,
// the one sequence every path takes (int8_sixteen_scores, int8_scale_sums, int8_four_whole), so a
// row's scores keep their bits whichever computed its sums.
VNNI_TARGET inline __m512 int8_scores_of_sums(__m512i sums, __m512i offset, __m512 key_scales, __m512 row_scale) {
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offset)), key_scales), row_scale);
}

// One row's scores (q: its code vectors) for keys j0..j0+15; those at or past `end` are not read.
template <int D>
VNNI_TARGET inline __m512 int8_sixteen_scores(const __m512i* q, int32_t offset, float scale, const uint8_t* keys,
                                              const float* key_scales, int64_t j0, int64_t end) {
  constexpr int H = Int8Keys<D>::kVectors;
  __m512i acc[16];
  if (j0 + 16 <= end) {
    UNROLLED for (int k = 0; k < 16; ++k) {
      acc[k] = _mm512_setzero_si512();
      UNROLLED for (int h = 0; h < H; ++h)
        acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_maskz_loadu_epi8(Int8Keys<D>::mask(h), keys + (j0 + k) * D + 64 * h), q[h]);
    }
  } else {
    for (int k = 0; k < 16; ++k) {
      acc[k] = _mm512_setzero_si512();
      if (j0 + k >= end) continue;
      UNROLLED for (int h = 0; h < H; ++h)
        acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_maskz_loadu_epi8(Int8Keys<D>::mask(h), keys + (j0 + k) * D + 64 * h), q[h]);
    }
  }
  const __mmask16 valid = end - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (end - j0)) - 1);
  return int8_scores_of_sums(sixteen_int_sums(acc), _mm512_set1_epi32(offset), _mm512_maskz_loadu_ps(valid, key_scales + j0),
                             _mm512_set1_ps(scale));
}

// A row's e over its `seen` keys (softmax done) as int16 weights in pairs (see the header), zero
// from its last pair up to pair `until`; returns f.
// w_j = e_j * value_scale_j for keys j..j+15, zero at or past `seen`.
VNNI_TARGET inline __m512 sixteen_value_weights(const float* e, const float* value_scales, int64_t j, int64_t seen) {
  const __mmask16 valid = seen - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (seen - j)) - 1);
  return _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, e + j), _mm512_maskz_loadu_ps(valid, value_scales + j));
}

VNNI_TARGET float int8_weights(const float* e, int64_t seen, const float* value_scales, int32_t* pairs, int64_t until) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; j += 16) largest = _mm512_max_ps(largest, sixteen_value_weights(e, value_scales, j, seen));
  const float w_max = _mm512_reduce_max_ps(largest);
  int16_t* const weights = reinterpret_cast<int16_t*>(pairs);
  const int64_t filled = (seen + 15) / 16 * 16;
  if (w_max > 0.0f) {
    const __m512 inverse = _mm512_set1_ps(kWeightCodes / w_max);
    for (int64_t j = 0; j < seen; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(sixteen_value_weights(e, value_scales, j, seen), inverse))));
  } else {
    std::memset(weights, 0, sizeof(int16_t) * size_t(filled));
  }
  for (int64_t j = filled; j < 2 * until; ++j) weights[j] = 0;
  return w_max > 0.0f ? w_max / kWeightCodes : 0.0f;
}

// Tile sums of four rows that each see the whole chunk (kChunk apart, int32; rows q_rows[r]) -> their
// partials' m and l (`stride` floats apart), int16 weights (kChunk / 2 pairs apart) and factors:
// int8_scores_of_sums, chunk_softmax_avx512 and int8_weights, each the same operations
// in the same order for each row (so the same bits), in three passes over the rows' scores instead
// of five, the four rows' dependent chains interleaved (as chunk_softmax_avx512_four_whole's).
VNNI_TARGET void int8_four_whole(const Int8Rows& q, const int64_t* q_rows, int32_t* sums, const float* key_scales,
                                 const float* value_scales, float* partials, int64_t stride, int32_t* pairs, float* factors) {
  constexpr int R = 4;
  float* const s = reinterpret_cast<float*>(sums);
  __m512i offset[R];
  __m512 row_scale[R], wide_max[R], largest[R];
  UNROLLED for (int r = 0; r < R; ++r) {
    offset[r] = _mm512_set1_epi32(q.offsets[q_rows[r]]);
    row_scale[r] = _mm512_set1_ps(q.scales[q_rows[r]]);
    wide_max[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    largest[r] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < kChunk; j += 16) {
    const __m512 key_scale = _mm512_loadu_ps(key_scales + j);
    UNROLLED for (int r = 0; r < R; ++r) {
      const __m512 v = int8_scores_of_sums(_mm512_load_si512(sums + r * kChunk + j), offset[r], key_scale, row_scale[r]);
      _mm512_store_ps(s + r * kChunk + j, v);
      wide_max[r] = _mm512_max_ps(wide_max[r], v);
    }
  }
  __m512 shift[R];
  __m256 total[R];
  UNROLLED for (int r = 0; r < R; ++r) {
    const float m = max_of(_mm256_max_ps(_mm512_castps512_ps256(wide_max[r]), _mm512_extractf32x8_ps(wide_max[r], 1)));
    partials[r * stride] = m;
    shift[r] = _mm512_set1_ps(m);
    total[r] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < kChunk; j += 16) {
    const __m512 value_scale = _mm512_loadu_ps(value_scales + j);
    UNROLLED for (int r = 0; r < R; ++r) {
      const __m512 e = exp_nonpositive_16(_mm512_sub_ps(_mm512_load_ps(s + r * kChunk + j), shift[r]));
      total[r] = _mm256_add_ps(total[r], _mm512_castps512_ps256(e));
      total[r] = _mm256_add_ps(total[r], _mm512_extractf32x8_ps(e, 1));
      const __m512 w = _mm512_mul_ps(e, value_scale);
      _mm512_store_ps(s + r * kChunk + j, w);
      largest[r] = _mm512_max_ps(largest[r], w);
    }
  }
  UNROLLED for (int r = 0; r < R; ++r) {
    partials[r * stride + 1] = sum_of(total[r]);
    const float w_max = _mm512_reduce_max_ps(largest[r]);
    int16_t* const weights = reinterpret_cast<int16_t*>(pairs + r * (kChunk / 2));
    factors[r] = w_max > 0.0f ? w_max / kWeightCodes : 0.0f;
    if (!(w_max > 0.0f)) {
      std::memset(weights, 0, sizeof(int16_t) * kChunk);
      continue;
    }
    const __m512 inverse = _mm512_set1_ps(kWeightCodes / w_max);
    for (int64_t j = 0; j < kChunk; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j),
                          _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(s + r * kChunk + j), inverse))));
  }
}

// Key pair values (keys j and j + 1, zeros at or past `end`) as int16, interleaved like
// interleaved_values (bf16_store_o puts them back in order).
template <int D>
VNNI_TARGET inline void int8_interleaved_values(const int8_t* values, int64_t j, int64_t end, __m512i* out) {
  UNROLLED for (int g = 0; g < (D + 31) / 32; ++g) {
    const __mmask32 mask = 32 * g + 32 <= D ? 0xFFFFFFFFu : __mmask32((1u << (D - 32 * g)) - 1);
    const __m512i a = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, values + j * D + 32 * g));
    const __m512i b = j + 1 < end ? _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, values + (j + 1) * D + 32 * g)) : _mm512_setzero_si512();
    out[2 * g] = _mm512_unpacklo_epi16(a, b);
    out[2 * g + 1] = _mm512_unpackhi_epi16(a, b);
  }
}

// o of NR rows (in memory, rows V vectors apart) += their weight pairs [p0, p1) times the values
// vbuf holds from p0 on.
template <int D, int NR>
VNNI_TARGET void int8_values_block(const int32_t* const* w, const __m512i* vbuf, int64_t p0, int64_t p1, __m512i* o_rows) {
  constexpr int V = Bf16Values<D>::kVectors;
  __m512i o[NR][V];
  UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int z = 0; z < V; ++z) o[r][z] = _mm512_load_si512(o_rows + r * V + z);
  for (int64_t p = p0; p < p1; ++p) {
    UNROLLED for (int z = 0; z < V; ++z) {
      const __m512i v = _mm512_load_si512(vbuf + (p - p0) * V + z);
      UNROLLED for (int r = 0; r < NR; ++r) o[r][z] = _mm512_dpwssd_epi32(o[r][z], _mm512_set1_epi32(w[r][p]), v);
    }
  }
  UNROLLED for (int r = 0; r < NR; ++r) UNROLLED for (int z = 0; z < V; ++z) _mm512_store_si512(o_rows + r * V + z, o[r][z]);
}

// ---- AMX tiles for an int8 cache's scores (many rows: prefill chunks, on CPUs with AMX-INT8) ----
//
// Why: a prefill chunk deep in a prompt multiplies every row by every key, and vpdpbusd does 64 of
// those products an instruction: a 256-token chunk at 16K of context ran at half the bf16 cache's
// speed, whose scores are on tiles. One tdpbsud multiplies up to 16 rows by 16 keys over 64
// dimensions. The operands are turned as in amx_tokens_scores: the rows' codes are A (signed), the
// keys as stored (code + 128, unsigned) are B, laid out as dimension quads x keys once per chunk and
// call. Each element is the integer sum of its row's and key's products, as vpdpbusd's, so a row's
// scores keep their bits whatever path its call takes (the row-invariance tests hold them equal);
// the float steps after it are int8_scores_of_sums'.
#define AMX_INT8_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

constexpr int64_t kAmxInt8Rows = 16;  // rows of a chunk's call from which its scores go to tiles

bool amx_int8_scores_available() {
  static const bool available = cpu_has_avx512_vnni() && __builtin_cpu_supports("amx-tile") &&
                                __builtin_cpu_supports("amx-int8") && amx_available();
  return available;
}

// Whether an int8 cache's many-row calls take their scores from tiles: heads of 32, 64 or 128
// dimensions (one or two A tiles), where chosen (DFLASH_ATTENTION_ISA=avx512-bf16 or =avx2 keeps
// every call on vpdpbusd, as it keeps a bf16 cache off tiles).
bool amx_int8_scores_chosen(int64_t D) {
  const char* forced = std::getenv("DFLASH_ATTENTION_ISA");
  if (forced != nullptr && (std::strcmp(forced, "avx2") == 0 || std::strcmp(forced, "avx512-bf16") == 0)) return false;
  return (D == 32 || D == 64 || D == 128) && amx_int8_scores_available();
}

// Tile sums [row][key] (int32, kChunk apart) of rows [from, count) -> their scores in place:
// int8_scores_of_sums, keys at or past `end` 0.
VNNI_TARGET void int8_scale_sums(const Int8Rows& q, int64_t h, int64_t first, int64_t from, int64_t count, const int64_t* positions,
                                 const float* key_scales, int64_t begin, int64_t end, float* scores) {
  for (int64_t i = from; i < count; ++i) {
    const int64_t row = q.index(h, first + i), stop = std::min(end, positions[i] + 1);
    const __m512i offset = _mm512_set1_epi32(q.offsets[row]);
    const __m512 scale = _mm512_set1_ps(q.scales[row]);
    float* const out = scores + i * kChunk;
    for (int64_t j0 = begin; j0 < stop; j0 += 16) {
      const __mmask16 valid = end - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (end - j0)) - 1);
      _mm512_store_ps(out + (j0 - begin),
                      int8_scores_of_sums(_mm512_load_si512(out + (j0 - begin)), offset, _mm512_maskz_loadu_ps(valid, key_scales + j0), scale));
    }
  }
}

// The scores of rows [from, count) of a chunk's call (int8_chunk_partials' rows, positions[i] each)
// over keys [begin, end): into scores + i * kChunk from the chunk's first key on.
template <int D>
AMX_INT8_TARGET void amx_int8_scores(const Int8Rows& q, int64_t h, int64_t first, int64_t from, int64_t count,
                                     const int64_t* positions, int64_t begin, int64_t end, const uint8_t* keys,
                                     const int8_t* values, float* scores) {
  static_assert(D == 32 || D == 64 || D == 128, "one or two A tiles of up to 64 dimensions hold a row's codes");
  constexpr int P = (D + 63) / 64, W = D / P;  // A tiles a row takes, dimensions each
  const int64_t stop = std::min(end, positions[count - 1] + 1);  // keys any row sees (position order)
  if (stop <= begin) return;
  const int64_t blocks = (stop - begin + 15) / 16;
  thread_local Scratch key_buffer;
  uint32_t* const laid = key_buffer.get<uint32_t>(size_t(blocks) * P * 256);  // [block][part][quad][key]
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = begin + 16 * b;
    for (int64_t line = 0; line < 16 * D; line += 64)  // the values into L2 for the pass after the softmax
      _mm_prefetch(reinterpret_cast<const char*>(values + j0 * D) + line, _MM_HINT_T1);
    for (int part = 0; part < P; ++part) {
      constexpr __mmask64 kPart = W == 64 ? ~__mmask64(0) : (__mmask64(1) << W) - 1;
      __m512 key_quads[16], quad_rows[16];  // key k's W / 4 dimension quads -> quad t's 16 keys
      UNROLLED for (int k = 0; k < 16; ++k)
        key_quads[k] = _mm512_castsi512_ps(j0 + k < end ? _mm512_maskz_loadu_epi8(kPart, keys + (j0 + k) * D + W * part)
                                                        : _mm512_setzero_si512());
      transpose16(key_quads, quad_rows);
      UNROLLED for (int t = 0; t < 16; ++t) _mm512_store_ps(laid + ((b * P + part) * 16 + t) * 16, quad_rows[t]);
    }
  }
  alignas(64) int8_t codes[16 * D];
  int32_t* const all_sums = reinterpret_cast<int32_t*>(scores);
  int configured = 0;  // rows the tiles are configured for: loading a configuration waits for every tile operation
  for (int64_t i0 = from; i0 < count; i0 += 16) {
    const int n = int(std::min<int64_t>(16, count - i0));
    const int64_t group_stop = std::min(end, positions[i0 + n - 1] + 1);
    const int64_t group_blocks = (group_stop - begin + 15) / 16;
    for (int r = 0; r < n; ++r) std::memcpy(codes + r * D, q.rows.q + q.index(h, first + i0 + r) * D, size_t(D));
    if (n != configured) {
      TileConfig config;  // tmm0, tmm1: sums (n rows x 16 keys); tmm2, tmm3: the rows' codes; tmm4-7: keys of two blocks
      for (int t = 0; t < 2; ++t) config.shape(t, n, 64);
      for (int t = 2; t < 4; ++t) config.shape(t, n, W);
      for (int t = 4; t < 8; ++t) config.shape(t, W / 4, 64);
      load_tiles(config);
      configured = n;
    }
    _tile_loadd(2, codes, D);
    if constexpr (P == 2) _tile_loadd(3, codes + W, D);
    int32_t* const sums = all_sums + i0 * kChunk;
    for (int64_t b = 0; b < group_blocks; ++b) {
      if (b % 2 == 0) {
        TURNED_SCORE_BLOCK(_tile_dpbsud, P, sums, 0, 4, 5)
      } else {
        TURNED_SCORE_BLOCK(_tile_dpbsud, P, sums, 1, 6, 7)
      }
    }
  }
  _tile_release();
}
#undef TURNED_SCORE_BLOCK

// The values of the same rows on tiles: o = the integer sum over the chunk's keys of each row's
// int16 weight (int8_weights) times the value codes, as vpdpwssd's pairs give it. Tiles multiply
// bytes, so a weight w (0..32767) is taken as 256 * high + low bytes: o = 256 * (high . v) + (low .
// v), each tdpbusd sum exact (at most 256 * 127 * 128 before the factor 256), so o has the same
// bits, and so has o * f after it. The value codes are laid out once per chunk and call as 64-key
// blocks of B tiles: [block][16 dimensions][key quad][dimension][4 keys].
template <int D>
AMX_INT8_TARGET void amx_int8_values(int64_t from, int64_t count, const int64_t* positions, const int32_t* weights,
                                     const float* factors, int64_t begin, int64_t end, const int8_t* values, float* out) {
  static_assert(D == 32 || D == 64 || D == 128, "whole 16-dimension groups, at most 64 dimensions a load");
  constexpr int kGroups = D / 16, kHalf = D < 64 ? D : 64;  // dimension groups (of 16), dimensions a load
  const int64_t blocks = (std::min(end, positions[count - 1] + 1) - begin + 63) / 64;
  if (blocks <= 0) return;
  thread_local Scratch value_buffer;
  int8_t* const laid = value_buffer.get<int8_t>(size_t(blocks) * kGroups * 1024);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int t = 0; t < 16; ++t) {  // keys j .. j + 3 -> row t of each group's B tile
      const int64_t j = begin + 64 * b + 4 * t;
      for (int half = 0; half * 64 < D; ++half) {
        constexpr __mmask64 kLoad = kHalf == 64 ? ~__mmask64(0) : (__mmask64(1) << kHalf) - 1;
        __m512i key[4];
        UNROLLED for (int u = 0; u < 4; ++u)
          key[u] = j + u < end ? _mm512_maskz_loadu_epi8(kLoad, values + (j + u) * D + 64 * half) : _mm512_setzero_si512();
        const __m512i ab_low = _mm512_unpacklo_epi8(key[0], key[1]), ab_high = _mm512_unpackhi_epi8(key[0], key[1]);
        const __m512i cd_low = _mm512_unpacklo_epi8(key[2], key[3]), cd_high = _mm512_unpackhi_epi8(key[2], key[3]);
        // in each 128-bit lane L (dimensions 16L..16L+15): the 4 keys of dimensions 0-3, 4-7, 8-11, 12-15
        const __m512i r0 = _mm512_unpacklo_epi16(ab_low, cd_low), r1 = _mm512_unpackhi_epi16(ab_low, cd_low);
        const __m512i r2 = _mm512_unpacklo_epi16(ab_high, cd_high), r3 = _mm512_unpackhi_epi16(ab_high, cd_high);
        const __m512i t0 = _mm512_shuffle_i32x4(r0, r1, 0x44), t1 = _mm512_shuffle_i32x4(r0, r1, 0xEE);
        const __m512i t2 = _mm512_shuffle_i32x4(r2, r3, 0x44), t3 = _mm512_shuffle_i32x4(r2, r3, 0xEE);
        const __m512i lanes[4] = {_mm512_shuffle_i32x4(t0, t2, 0x88), _mm512_shuffle_i32x4(t0, t2, 0xDD),
                                  _mm512_shuffle_i32x4(t1, t3, 0x88), _mm512_shuffle_i32x4(t1, t3, 0xDD)};
        UNROLLED for (int L = 0; L < kHalf / 16; ++L)
          _mm512_store_si512(laid + ((b * kGroups + 4 * half + L) * 16 + t) * 64, lanes[L]);
      }
    }
  }
  alignas(64) uint8_t low[4][16][64], high[4][16][64];  // [block][row][key]: the weights' bytes, A tiles
  alignas(64) int32_t low_sums[16][64], high_sums[16][64];  // [row][dimension of up to 4 groups]
  int configured = 0;
  for (int64_t i0 = from; i0 < count; i0 += 16) {
    const int n = int(std::min<int64_t>(16, count - i0));
    const int64_t keys = std::min(end, positions[i0 + n - 1] + 1) - begin;  // the group's last row sees the most
    const int64_t group_blocks = (keys + 63) / 64, zeroed = (keys + 1) / 2 * 2;  // int8_weights' zeros end there
    for (int r = 0; r < n; ++r) {
      const int16_t* w = reinterpret_cast<const int16_t*>(weights + (i0 + r) * kChunk / 2);
      for (int64_t b = 0; b < group_blocks; ++b) {
        for (int half = 0; half < 2; ++half) {
          const int64_t k0 = 64 * b + 32 * half;
          const __mmask32 valid = zeroed - k0 >= 32 ? ~__mmask32(0) : zeroed <= k0 ? 0 : __mmask32((1u << (zeroed - k0)) - 1);
          const __m512i pair = _mm512_maskz_loadu_epi16(valid, w + k0);
          _mm256_store_si256(reinterpret_cast<__m256i*>(&low[b][r][32 * half]), _mm512_cvtepi16_epi8(pair));
          _mm256_store_si256(reinterpret_cast<__m256i*>(&high[b][r][32 * half]), _mm512_cvtepi16_epi8(_mm512_srli_epi16(pair, 8)));
        }
      }
    }
    if (n != configured) {
      TileConfig config;  // tmm0-3: sums of 4 dimension groups (n rows x 16); tmm4: weight bytes; tmm5: value codes
      for (int t = 0; t < 5; ++t) config.shape(t, n, 64);
      config.shape(5, 16, 64);
      load_tiles(config);
      configured = n;
    }
    for (int g0 = 0; g0 < kGroups; g0 += 4) {
      for (int part = 0; part < 2; ++part) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < group_blocks; ++b) {
          _tile_loadd(4, part == 0 ? &low[b][0][0] : &high[b][0][0], 64);
          const int8_t* block = laid + (b * kGroups + g0) * 1024;
          _tile_loadd(5, block, 64);
          _tile_dpbusd(0, 4, 5);
          _tile_loadd(5, block + 1024, 64);
          _tile_dpbusd(1, 4, 5);
          if constexpr (kGroups >= 4) {
            _tile_loadd(5, block + 2048, 64);
            _tile_dpbusd(2, 4, 5);
            _tile_loadd(5, block + 3072, 64);
            _tile_dpbusd(3, 4, 5);
          }
        }
        int32_t* const sums = part == 0 ? &low_sums[0][0] : &high_sums[0][0];
        _tile_stored(0, sums, 256);
        _tile_stored(1, sums + 16, 256);
        if constexpr (kGroups >= 4) {
          _tile_stored(2, sums + 32, 256);
          _tile_stored(3, sums + 48, 256);
        }
      }
      for (int r = 0; r < n; ++r) {
        const __m512 factor = _mm512_set1_ps(factors[i0 + r]);
        float* const o = out + (i0 + r) * (D + 2) + 2 + 16 * g0;
        UNROLLED for (int g = 0; g < std::min(4, kGroups); ++g) {
          const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(&high_sums[r][16 * g]), 8),
                                               _mm512_load_si512(&low_sums[r][16 * g]));
          _mm512_storeu_ps(o + 16 * g, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), factor));
        }
      }
    }
  }
  _tile_release();
}

// Partials of rows [first, last) of KV head h over chunk c (rows whose position is below the chunk
// are left alone), whatever their tokens: each block of 16 keys and of 16 value pairs is read once
// for all the rows. keys/values/scales: this head's, from position 0; out: row first's partial.
template <int D>
VNNI_TARGET void int8_chunk_partials(const Int8Rows& q, int64_t h, int64_t first, int64_t last, int64_t c, const uint8_t* keys,
                                     const int8_t* values, const float* key_scales, const float* value_scales, float* out) {
  constexpr int H = Int8Keys<D>::kVectors, V = Bf16Values<D>::kVectors, NR = Bf16Values<D>::kRows;
  constexpr int64_t kPairBlock = 16;
  const Rows<int8_t>& rows = q.rows;
  const int64_t begin = c * kChunk, end = std::min(begin + kChunk, rows.position(last - 1) + 1);  // keys any row sees
  const int64_t count = last - first, pairs = (end - begin + 1) / 2;
  thread_local Scratch position_buffer, score_buffer, factor_buffer, weight_buffer, o_buffer, block_buffer;
  int64_t* const positions = position_buffer.get<int64_t>(size_t(count));
  float* const scores = score_buffer.get<float>(size_t(count) * kChunk);
  float* const factors = factor_buffer.get<float>(size_t(count));
  int32_t* const weights = weight_buffer.get<int32_t>(size_t(count) * kChunk / 2);
  __m512i* const o = o_buffer.get<__m512i>(size_t(count) * V);
  __m512i* const vbuf = block_buffer.get<__m512i>(size_t(kPairBlock) * V);
  for (int64_t i = 0; i < count; ++i) positions[i] = rows.position(first + i);
  int64_t active = 0;  // rows before it see nothing of this chunk (rows are in position order)
  while (active < count && positions[active] < begin) ++active;
  bool on_tiles = false;
  int64_t whole = count;  // the rows from which every row sees the whole chunk, in fours (tiles only)
  if constexpr (D == 32 || D == 64 || D == 128) {
    if (count - active >= kAmxInt8Rows && q.tiles) {
      amx_int8_scores<D>(q, h, first, active, count, positions, begin, end, keys, values, scores);
      if (end - begin == kChunk) {
        whole = active;
        while (whole < count && positions[whole] < end - 1) ++whole;
        whole += (count - whole) % 4;  // the rows left over go one by one
      }
      int8_scale_sums(q, h, first, active, whole, positions, key_scales, begin, end, scores);
      on_tiles = true;
    }
  }
  if (!on_tiles) {  // else the scores, 16 keys at a time for every row that sees them
    for (int64_t j0 = begin; j0 < end; j0 += 16) {
      for (int64_t line = 0; line < 16 * D; line += 64) {  // the next keys into L1, these keys' values into L2
        _mm_prefetch(reinterpret_cast<const char*>(keys + (j0 + kPrefetchKeys) * D) + line, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(values + j0 * D) + line, _MM_HINT_T1);
      }
      for (int64_t i = active; i < count; ++i) {
        if (positions[i] < j0) continue;
        const int64_t row = q.index(h, first + i);
        __m512i query[H];
        UNROLLED for (int v = 0; v < H; ++v) query[v] = _mm512_maskz_loadu_epi8(Int8Keys<D>::mask(v), rows.q + row * D + 64 * v);
        _mm512_storeu_ps(scores + i * kChunk + (j0 - begin),
                         int8_sixteen_scores<D>(query, q.offsets[row], q.scales[row], keys, key_scales, j0, end));
      }
    }
  }
  for (int64_t i = active; i < whole; ++i) {
    const int64_t seen = std::min(end, positions[i] + 1) - begin;
    chunk_softmax(scores + i * kChunk, seen, Partial{out + i * (D + 2)});
    factors[i] = int8_weights(scores + i * kChunk, seen, value_scales + begin, weights + i * kChunk / 2, pairs);
  }
  for (int64_t i = whole; i < count; i += 4) {
    const int64_t q_rows[4] = {q.index(h, first + i), q.index(h, first + i + 1), q.index(h, first + i + 2), q.index(h, first + i + 3)};
    int8_four_whole(q, q_rows, reinterpret_cast<int32_t*>(scores + i * kChunk), key_scales + begin, value_scales + begin,
                    out + i * (D + 2), D + 2, weights + i * kChunk / 2, factors + i);
  }
  if constexpr (D == 32 || D == 64 || D == 128) {
    if (on_tiles) return amx_int8_values<D>(active, count, positions, weights, factors, begin, end, values, out);
  }
  // values, 16 pairs at a time for groups of NR rows
  std::memset(static_cast<void*>(o + active * V), 0, sizeof(__m512i) * V * size_t(count - active));
  const int32_t* rows_w[NR];
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairBlock) {
    const int64_t p1 = std::min(pairs, p0 + kPairBlock);
    for (int64_t p = p0; p < p1; ++p) int8_interleaved_values<D>(values, begin + 2 * p, end, vbuf + (p - p0) * V);
    for (int64_t i = active; i < count; i += NR) {
      const int n = int(std::min<int64_t>(NR, count - i));
      const int64_t until = std::min(p1, (std::min(end, positions[i + n - 1] + 1) - begin + 1) / 2);  // its last row's pairs
      if (until <= p0) continue;
      for (int r = 0; r < n; ++r) rows_w[r] = weights + (i + r) * kChunk / 2;
      with_rows<NR>(n, [&](auto k) { int8_values_block<D, decltype(k)::value>(rows_w, vbuf, p0, until, o + i * V); });
    }
  }
  for (int64_t i = active; i < count; ++i) {
    alignas(64) __m512 scaled[V];
    UNROLLED for (int z = 0; z < V; ++z) scaled[z] = _mm512_mul_ps(_mm512_cvtepi32_ps(o[i * V + z]), _mm512_set1_ps(factors[i]));
    bf16_store_o<D>(scaled, out + i * (D + 2) + 2);
  }
}

template <int D, typename OT>
void attend_int8(const Int8Rows& q, const uint8_t* keys, const int8_t* values, const float* key_scales, const float* value_scales,
                 int64_t head_stride, int64_t scale_stride, int64_t KV, OT* out) {
  schedule<D>(q.rows, KV, out, [&](int64_t h, int64_t first, int64_t last, int64_t c, float* into) {
    int8_chunk_partials<D>(q, h, first, last, c, keys + h * head_stride, values + h * head_stride, key_scales + h * scale_stride,
                           value_scales + h * scale_stride, into);
  });
}

// a key's and a value's row (of one KV head) into an int8 cache at `at`, their scales at `scale_at`
// (quantize_kv's layout): the one quantization every cached row takes
template <typename T>
VNNI_TARGET void quantize_kv_row(const T* k, const T* v, uint8_t* key_codes, int8_t* value_codes, float* key_scales,
                                 float* value_scales, int64_t at, int64_t scale_at, int64_t D) {
  int8_t* key_row = reinterpret_cast<int8_t*>(key_codes + at);
  key_scales[scale_at] = quantize_row(k, D, key_row);
  for (int64_t d = 0; d < D; ++d) key_codes[at + d] = uint8_t(int(key_row[d]) + kKeyOffset);
  value_scales[scale_at] = quantize_row(v, D, value_codes + at);
}

// Query rows (count of them, D each) quantized for int8_chunk_partials (Int8Rows): codes, each row's
// scale times 1/sqrt(D), and 128 times its codes' sum.
template <typename T>
VNNI_TARGET void quantize_queries(const T* q, int64_t count, int64_t D, int8_t* codes, float* scales, int32_t* offsets) {
  const float softmax_scale = 1.0f / std::sqrt(float(D));
  for (int64_t row = 0; row < count; ++row) {
    scales[row] = quantize_row(q + row * D, D, codes + row * D) * softmax_scale;
    int32_t sum = 0;
    for (int64_t d = 0; d < D; ++d) sum += codes[row * D + d];
    offsets[row] = kKeyOffset * sum;
  }
}

// ---- a draft tree's rows in one call (tree_chain.h) -------------------------------------------
//
// Why: attended chain by chain (one causal call each), every chain read the whole cache again and
// paid its own call: a tree of 16 rows in 15 chains cost 2.06x a decode step at 1K of context
// against 1.38x for one chain of 16 (bench/step.py, bf16, AMX VM, 2 threads). Here the chunks
// wholly below `start` hold committed keys only, and every row of the tree sees them whole: a row's
// partial over a chunk it sees whole does not depend on its position or on the rows beside it, so
// those partials are computed once, for all rows at once. The chunks from start's on hold each
// chain's path: per KV head (a head's cache rows are its own), each chain's path is written at
// start.. and its rows' partials over those chunks computed; then each row merges its partials in
// chunk order. The same partials and the same merges as the chain's own causal call, so the same
// bits (tests/model/test_native.py).
//
// rows(first, position, tokens): the call's rows (Rows or Int8Rows) of tokens first.. at positions
// position..; partials(rows, h, first, last, c, into): schedule's callback, for those rows;
// write_path(h, chain): the chain's path keys and values of head h at start...
inline const Rows<int8_t>& positions_of(const Int8Rows& rows) { return rows.rows; }
template <typename QT>
inline const Rows<QT>& positions_of(const Rows<QT>& rows) { return rows; }

template <int D, typename OT, typename MakeRows, typename Partials, typename WritePath>
void attend_tree(int64_t tokens, int64_t H, int64_t KV, int64_t start, const std::vector<TreeChain>& chains, OT* out,
                 MakeRows&& make_rows, Partials&& partials, WritePath&& write_path) {
  const int64_t G = H / KV, R = tokens * G, S = D + 2, shared = start / kChunk;
  // the committed chunks: every (head, chunk, part of the rows) a task (few_rows_tasks, as schedule)
  auto shared_partials = partial_buffer(std::max<int64_t>(KV * shared * R, 1), D);
  if (shared > 0) {
    const auto all = make_rows(0, start, tokens);  // positions start.., past every shared chunk
    few_rows_tasks(KV, shared, R, [&](int64_t h, int64_t first, int64_t last, int64_t c) {
      partials(all, h, first, last, c, shared_partials.get() + ((h * shared + c) * R + first) * S);
    }, 2 * KV * R * shared * kChunk * D >= step_pool::kWorthWakingMacs);
  }
  // the chains' chunks, per KV head: each chain's path written, its rows' partials over the chunks
  // from start's on, and every row merged and finished
  int64_t tail_macs = 0, widest = 1;
  for (const auto& chain : chains) {
    const int64_t last_position = start + chain.depth + (chain.end - chain.first) - 1;
    tail_macs += 2 * KV * (chain.end - chain.first) * G * (last_position + 1 - shared * kChunk) * D;
    widest = std::max(widest, (chain.end - chain.first) * G * (last_position / kChunk - shared + 1));
  }
  step_pool::parallel_tasks(KV, [&](int64_t h) {
    auto tail = partial_buffer(widest, D), state_buffer = partial_buffer(1, D);
    const Partial state{state_buffer.get()};
    for (const auto& chain : chains) {
      write_path(h, chain);
      const auto rows = make_rows(chain.first, start + chain.depth, chain.end - chain.first);
      const auto& at = positions_of(rows);
      const int64_t count = at.count(), chunks = at.position(count - 1) / kChunk - shared + 1;
      for (int64_t c = 0; c < chunks; ++c) partials(rows, h, 0, count, shared + c, tail.get() + c * count * S);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t row = chain.first * G + i, row_chunks = at.position(i) / kChunk - shared + 1;
        int64_t c = 0;
        if (shared > 0) {
          std::memcpy(state.p, shared_partials.get() + (h * shared * R + row) * S, sizeof(float) * S);
          for (int64_t s = 1; s < shared; ++s) merge(state, Partial{shared_partials.get() + ((h * shared + s) * R + row) * S}, D);
        } else {
          std::memcpy(state.p, tail.get() + i * S, sizeof(float) * S);
          c = 1;
        }
        for (; c < row_chunks; ++c) merge(state, Partial{tail.get() + (c * count + i) * S}, D);
        finish(state, out + ((chain.first + i / G) * H + h * G + i % G) * D, D);
      }
    }
  }, tail_macs >= step_pool::kWorthWakingMacs);
}

// The head dim as a compile-time constant: run(std::integral_constant<int, D>).
template <typename F>
void with_head_dim(int64_t D, F&& run) {
  switch (D) {
    case 16: run(std::integral_constant<int, 16>{}); break;
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 256>{}); break;
  }
}

}  // namespace

bool causal_attention_available() { return cpu_has_avx2_fma(); }

// How a bf16 cache is multiplied: "amx-bf16" (the scores on AMX tiles, the values as bf16 dot
// products), "avx512-bf16" (both as bf16 dot products) or "avx2" (fp32 fmas).
std::string causal_attention_isa() {
  if (!bf16_values_chosen()) return "avx2";
  return amx_scores_chosen() ? "amx-bf16" : "avx512-bf16";
}

// Every value DFLASH_ATTENTION_ISA may choose on this CPU.
std::vector<std::string> causal_attention_isas() {
  std::vector<std::string> isas{"avx2"};
  if (cpu_has_avx512_bf16()) isas.push_back("avx512-bf16");
  if (amx_scores_available()) isas.push_back("amx-bf16");
  return isas;
}

// Which softmax implementations this CPU runs: "avx2", and "avx512" where it has AVX512F/DQ (the
// one chosen there). They give the same bits; softmax_rows runs either, for the tests.
std::vector<std::string> chunk_softmax_isas() {
  std::vector<std::string> isas{"avx2"};
  if (chunk_softmax_wide()) isas.push_back("avx512");
  return isas;
}

// The chunk softmax over rows of scores [R, 256] fp32, row r seeing seen[r] (1..256) keys, with the
// implementation `isa` (chunk_softmax_isas): (e [R, 256], m [R], l [R]); e past a row's keys is 0 up
// to the next multiple of 8 and the scores as given after that.
std::vector<at::Tensor> softmax_rows(const at::Tensor& scores, const at::Tensor& seen, const std::string& isa) {
  TORCH_CHECK(cpu_has_avx2_fma(), "softmax_rows: needs AVX2 + FMA");
  const auto isas = chunk_softmax_isas();
  TORCH_CHECK(std::find(isas.begin(), isas.end(), isa) != isas.end(), "softmax_rows: isa ", isa, " is not one of this CPU's");
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) == kChunk && scores.scalar_type() == at::kFloat, "softmax_rows: scores [R, ",
              kChunk, "] float32, not ", scores.sizes(), " ", scores.scalar_type());
  TORCH_CHECK(seen.dim() == 1 && seen.size(0) == scores.size(0) && seen.scalar_type() == at::kLong, "softmax_rows: seen [",
              scores.size(0), "] int64, not ", seen.sizes(), " ", seen.scalar_type());
  auto e = scores.contiguous().clone();
  auto counts = seen.contiguous();
  const int64_t R = e.size(0);
  auto m = at::empty({R}, e.options()), l = at::empty({R}, e.options());
  std::vector<float> partial(2 + kMaxDim);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = counts.data_ptr<int64_t>()[r];
    TORCH_CHECK(n >= 1 && n <= kChunk, "softmax_rows: seen[", r, "] = ", n, " is not in 1..", kChunk);
    const Partial p{partial.data()};
    if (isa == "avx512") chunk_softmax_avx512(e.data_ptr<float>() + r * kChunk, n, p);
    else chunk_softmax_avx2(e.data_ptr<float>() + r * kChunk, n, p);
    m.data_ptr<float>()[r] = p.m();
    l.data_ptr<float>()[r] = p.l();
  }
  return {e, m, l};
}

// The sequence of operations over a bf16 cache, bumped whenever it changes (a disk snapshot names it,
// loading.numerics): 1, the values as bf16 dot products; 2, the scores too; 3, exp_nonpositive's
// base-2 reduction (every path, fp32 caches too: model.attention_description names it on each).
int64_t causal_attention_revision() { return 3; }

// Whether this CPU attends over an int8 cache (causal_attention_int8, quantize_kv).
bool int8_kv_available() { return cpu_has_avx512_vnni(); }

// Whether an int8 cache's calls of many rows take their scores and values from AMX tiles, for head
// dim D (amx_int8_scores, amx_int8_values; the same bits as vpdpbusd's).
bool int8_kv_tiles(int64_t D) { return amx_int8_scores_chosen(D); }

// The sequence of operations over an int8 cache, bumped whenever it changes (a disk snapshot names it):
// 2, exp_nonpositive's base-2 reduction.
int64_t int8_kv_revision() { return 2; }

namespace {
void check_int8_layer(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales, const at::Tensor& value_scales,
                      const char* where) {
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.scalar_type() == at::kByte && values.scalar_type() == at::kChar,
              where, ": keys [KV, L, D] uint8 and values int8 of the same shape, not ", keys.sizes(), " ", keys.scalar_type(),
              " and ", values.sizes(), " ", values.scalar_type());
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == keys.size(2) && values.strides() == keys.strides(), where,
              ": keys and values must be [KV, L, D] with rows of D contiguous");
  TORCH_CHECK(key_scales.dim() == 2 && key_scales.size(0) == keys.size(0) && key_scales.size(1) == keys.size(1) &&
                  key_scales.scalar_type() == at::kFloat && key_scales.stride(1) == 1 && value_scales.sizes() == key_scales.sizes() &&
                  value_scales.strides() == key_scales.strides() && value_scales.scalar_type() == at::kFloat,
              where, ": scales [KV, L] float32 with L contiguous, not ", key_scales.sizes(), " and ", value_scales.sizes());
}
}  // namespace

// k, v [T, KV, D] (bf16 or fp32): rows start..start+T-1 of an int8 layer (keys [KV, L, D] uint8 as
// code + 128, values int8, their scales [KV, L] float32), by quantize_row.
void quantize_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor keys, at::Tensor values, at::Tensor key_scales,
                 at::Tensor value_scales, int64_t start) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "quantize_kv: needs AVX512-VNNI (quantize_row runs on 16 lanes)");
  check_int8_layer(keys, values, key_scales, value_scales, "quantize_kv");
  const int64_t T = k.size(0), KV = keys.size(0), L = keys.size(1), D = keys.size(2);
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128 || D == 256, "quantize_kv: head dim ", D, " (16, 32, 64, 128 or 256)");
  TORCH_CHECK(k.dim() == 3 && k.size(1) == KV && k.size(2) == D && v.sizes() == k.sizes(), "quantize_kv: k ", k.sizes(), ", v ",
              v.sizes(), " for a cache of ", KV, " heads of ", D);
  TORCH_CHECK(start >= 0 && start + T <= L, "quantize_kv: positions ", start, "..", start + T, " past ", L);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat),
              "quantize_kv: k ", k.scalar_type(), ", v ", v.scalar_type(), " (bf16 or fp32)");
  auto k_rows = k.contiguous(), v_rows = v.contiguous();
  const int64_t head_stride = keys.stride(0), scale_stride = key_scales.stride(0);
  uint8_t* const key_codes = keys.data_ptr<uint8_t>();
  int8_t* const value_codes = values.data_ptr<int8_t>();
  float *const ks = key_scales.data_ptr<float>(), *const vs = value_scales.data_ptr<float>();
  auto run = [&](auto type) {
    using T_ = decltype(type);
    const T_ *kx = k_rows.data_ptr<T_>(), *vx = v_rows.data_ptr<T_>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < KV; ++h) {
        const int64_t row = (t * KV + h) * D;
        quantize_kv_row(kx + row, vx + row, key_codes, value_codes, ks, vs, h * head_stride + (start + t) * D,
                        h * scale_stride + start + t, D);
      }
    }
  };
  if (k.scalar_type() == at::kBFloat16) run(at::BFloat16{});
  else run(float{});
}

// causal_attention over an int8 layer (quantize_kv's): q [T, H, D] (bf16 or fp32) -> [T, H, D] in q's dtype.
at::Tensor causal_attention_int8(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales,
                                 const at::Tensor& value_scales, int64_t start) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "causal_attention_int8: needs AVX512-VNNI");
  check_int8_layer(keys, values, key_scales, value_scales, "causal_attention_int8");
  TORCH_CHECK(q.dim() == 3, "causal_attention_int8: q ", q.sizes());
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = keys.size(0), L = keys.size(1);
  TORCH_CHECK(keys.size(2) == D && (D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && H % KV == 0,
              "causal_attention_int8: head dim ", D, " (16, 32, 64, 128 or 256), ", H, " query heads over ", KV, " KV heads");
  TORCH_CHECK(start >= 0 && start + T <= L, "causal_attention_int8: positions ", start, "..", start + T, " past ", L, " cached");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "causal_attention_int8: q ", q.scalar_type());
  auto query = q.contiguous();
  auto out = at::empty({T, H, D}, query.options());
  if (T == 0) return out;
  auto codes = at::empty({T, H, D}, query.options().dtype(at::kChar));
  std::vector<float> scales(size_t(T * H));
  std::vector<int32_t> offsets(size_t(T * H));
  const float softmax_scale = 1.0f / std::sqrt(float(D));
  if (query.scalar_type() == at::kBFloat16) {
    quantize_queries(query.data_ptr<at::BFloat16>(), T * H, D, codes.data_ptr<int8_t>(), scales.data(), offsets.data());
  } else {
    quantize_queries(query.data_ptr<float>(), T * H, D, codes.data_ptr<int8_t>(), scales.data(), offsets.data());
  }
  const Int8Rows rows{Rows<int8_t>{codes.data_ptr<int8_t>(), start, T, H / KV, H, D, softmax_scale}, scales.data(), offsets.data(),
                      amx_int8_scores_chosen(D)};
  auto run = [&](auto out_type) {
    using OT = decltype(out_type);
    const uint8_t* k = keys.data_ptr<uint8_t>();
    const int8_t* v = values.data_ptr<int8_t>();
    const float *ks = key_scales.data_ptr<float>(), *vs = value_scales.data_ptr<float>();
    OT* o = out.data_ptr<OT>();
    const int64_t hs = keys.stride(0), ss = key_scales.stride(0);
    switch (D) {
      case 16: attend_int8<16>(rows, k, v, ks, vs, hs, ss, KV, o); break;
      case 32: attend_int8<32>(rows, k, v, ks, vs, hs, ss, KV, o); break;
      case 64: attend_int8<64>(rows, k, v, ks, vs, hs, ss, KV, o); break;
      case 128: attend_int8<128>(rows, k, v, ks, vs, hs, ss, KV, o); break;
      default: attend_int8<256>(rows, k, v, ks, vs, hs, ss, KV, o); break;
    }
  };
  if (query.scalar_type() == at::kBFloat16) run(at::BFloat16{});
  else run(float{});
  return out;
}

// q [T, H, D] (the new tokens, at positions start..start+T-1), keys/values [KV, L, D] (a layer of the
// cache, positions 0..start+T-1 written) -> [T, H, D] in the cache's dtype. H = G * KV, query head
// h * G + g reads KV head h (model.grouped_query_attention's grouping).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start) {
  TORCH_CHECK(cpu_has_avx2_fma(), "causal_attention: needs AVX2 and FMA");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "causal_attention: q ", q.sizes(),
              ", keys ", keys.sizes(), ", values ", values.sizes());
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = keys.size(0), L = keys.size(1);
  TORCH_CHECK(keys.size(2) == D && (D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && H % KV == 0,
              "causal_attention: head dim ", D, " (16, 32, 64, 128 or 256), ", H, " query heads over ", KV, " KV heads");
  TORCH_CHECK(start >= 0 && start + T <= L, "causal_attention: positions ", start, "..", start + T, " past ", L, " cached");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "causal_attention: keys ", keys.scalar_type(), ", values ", values.scalar_type());
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == D && values.strides() == keys.strides(),
              "causal_attention: keys and values must be [KV, L, D] with rows of D contiguous");
  auto query = q.contiguous();
  auto out = at::empty({T, H, D}, q.options().dtype(keys.scalar_type()));
  if (T == 0) return out;
  const float scale = 1.0f / std::sqrt(float(D));
  const bool bf16_values = bf16_values_chosen();  // used where the cache is bf16
  auto run = [&](auto q_type, auto kv_type) {
    using QT = decltype(q_type);
    using KT = decltype(kv_type);
    Rows<QT> rows{query.data_ptr<QT>(), start, T, H / KV, H, D, scale, amx_rows(bf16_values, D)};
    const KT *k = keys.data_ptr<KT>(), *v = values.data_ptr<KT>();
    KT* o = out.data_ptr<KT>();
    switch (D) {  // the head dims of the families we load; compile-time, so o[] and the loops live in registers
      case 16: attend<16>(rows, k, v, keys.stride(0), L, KV, o, bf16_values); break;
      case 32: attend<32>(rows, k, v, keys.stride(0), L, KV, o, bf16_values); break;
      case 64: attend<64>(rows, k, v, keys.stride(0), L, KV, o, bf16_values); break;
      case 128: attend<128>(rows, k, v, keys.stride(0), L, KV, o, bf16_values); break;
      default: attend<256>(rows, k, v, keys.stride(0), L, KV, o, bf16_values); break;
    }
  };
  const bool bf16_q = query.scalar_type() == at::kBFloat16, bf16_kv = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_q || query.scalar_type() == at::kFloat) && (bf16_kv || keys.scalar_type() == at::kFloat),
              "causal_attention: q ", query.scalar_type(), " and cache ", keys.scalar_type(), " (fp32 or bf16)");
  if (bf16_q && bf16_kv) run(at::BFloat16{}, at::BFloat16{});
  else if (bf16_q) run(at::BFloat16{}, float{});
  else if (bf16_kv) run(float{}, at::BFloat16{});
  else run(float{}, float{});
  return out;
}

namespace {
// attend<D> on raw rows of one type (q, cache and out alike), D chosen at run time.
template <typename T>
void attend_rows(const T* q, int64_t rows_count, int64_t H, int64_t D, const T* keys, const T* values, int64_t KV, int64_t L,
                 int64_t head_stride, int64_t start, T* out, bool bf16_values) {
  if (rows_count == 0) return;
  const Rows<T> rows{q, start, rows_count, H / KV, H, D, 1.0f / std::sqrt(float(D)), amx_rows(bf16_values, D)};
  switch (D) {
    case 16: attend<16>(rows, keys, values, head_stride, L, KV, out, bf16_values); break;
    case 32: attend<32>(rows, keys, values, head_stride, L, KV, out, bf16_values); break;
    case 64: attend<64>(rows, keys, values, head_stride, L, KV, out, bf16_values); break;
    case 128: attend<128>(rows, keys, values, head_stride, L, KV, out, bf16_values); break;
    default: attend<256>(rows, keys, values, head_stride, L, KV, out, bf16_values); break;
  }
}
}  // namespace

// causal_attention on raw rows, for decode_layers' loops without ATen calls (their callers checked
// the shapes once): q [T, H, D] contiguous, a layer's keys and values [KV, L, D] with heads
// head_stride apart, out [T, H, D], all bf16 (a served cache) or all fp32 (the DFlash drafter's
// cache on CPU: draft_layers). The same calls as causal_attention, so the same bits.
void causal_attention_bf16_into(const at::BFloat16* q, int64_t T, int64_t H, int64_t D, const at::BFloat16* keys,
                                const at::BFloat16* values, int64_t KV, int64_t L, int64_t head_stride, int64_t start,
                                at::BFloat16* out) {
  attend_rows(q, T, H, D, keys, values, KV, L, head_stride, start, out, bf16_values_chosen());
}

void causal_attention_f32_into(const float* q, int64_t T, int64_t H, int64_t D, const float* keys, const float* values,
                               int64_t KV, int64_t L, int64_t head_stride, int64_t start, float* out) {
  attend_rows(q, T, H, D, keys, values, KV, L, head_stride, start, out, false);
}

namespace {
void check_tree_rows(int64_t tokens, int64_t H, int64_t D, int64_t KV, int64_t L, int64_t start) {
  TORCH_CHECK(start >= 0 && start + tokens <= L, "tree attention: rows at ", start, "..", start + tokens, " past ", L, " cached");
  TORCH_CHECK((D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && KV > 0 && H % KV == 0,
              "tree attention: head dim ", D, " (16, 32, 64, 128 or 256), ", H, " query heads over ", KV, " KV heads");
}
}  // namespace

// A draft tree's attention in one call (attend_tree): q [T, H, D] its rows (tree_chain.h), a layer's
// keys and values [KV, L, D] (heads head_stride apart, positions 0..start-1 committed), new_keys and
// new_values row t's key and value for KV head h at t * stride + h * D; out [T, H, D]. Writes each
// chain's path at start.., chain 0's last. bf16 (a served cache) or fp32 throughout.
template <typename T>
void tree_attention_into(const T* q, int64_t tokens, int64_t H, int64_t D, T* keys, T* values, int64_t KV, int64_t L,
                         int64_t head_stride, int64_t start, const std::vector<TreeChain>& chains, const T* new_keys,
                         int64_t key_stride, const T* new_values, int64_t value_stride, T* out) {
  check_tree_rows(tokens, H, D, KV, L, start);
  if (tokens == 0) return;
  const bool bf16_values = std::is_same_v<T, at::BFloat16> && bf16_values_chosen(), amx = amx_rows(bf16_values, D);
  const float scale = 1.0f / std::sqrt(float(D));
  with_head_dim(D, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    attend_tree<kD>(tokens, H, KV, start, chains, out,
        [&](int64_t first, int64_t position, int64_t count) {
          return Rows<T>{q + first * H * D, position, count, H / KV, H, D, scale, amx};
        },
        [&](const Rows<T>& rows, int64_t h, int64_t first, int64_t last, int64_t c, float* into) {
          const T *head_keys = keys + h * head_stride, *head_values = values + h * head_stride;
          if constexpr (std::is_same_v<T, at::BFloat16>) {
            if (bf16_values) return chunk_partials<kD, true>(rows, h, first, last, c, head_keys, head_values, L, into);
          }
          chunk_partials<kD, false>(rows, h, first, last, c, head_keys, head_values, L, into);
        },
        [&](int64_t h, const TreeChain& chain) {
          for (size_t i = 0; i < chain.path.size(); ++i) {
            const int64_t at = h * head_stride + (start + int64_t(i)) * D;
            std::memcpy(keys + at, new_keys + chain.path[i] * key_stride + h * D, sizeof(T) * D);
            std::memcpy(values + at, new_values + chain.path[i] * value_stride + h * D, sizeof(T) * D);
          }
        });
  });
}
template void tree_attention_into<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, int64_t, at::BFloat16*, at::BFloat16*,
                                                int64_t, int64_t, int64_t, int64_t, const std::vector<TreeChain>&,
                                                const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, at::BFloat16*);
template void tree_attention_into<float>(const float*, int64_t, int64_t, int64_t, float*, float*, int64_t, int64_t, int64_t,
                                         int64_t, const std::vector<TreeChain>&, const float*, int64_t, const float*, int64_t,
                                         float*);

// tree_attention_into over an int8 layer (quantize_kv's layout: codes [KV, L, D] heads head_stride
// apart, scales [KV, L] scale_stride apart): each chain's path quantized into it at start.., the
// queries quantized once; q, new rows and out bf16 or fp32 alike.
template <typename T>
void tree_attention_int8_into(const T* q, int64_t tokens, int64_t H, int64_t D, uint8_t* keys, int8_t* values,
                              float* key_scales, float* value_scales, int64_t KV, int64_t L, int64_t head_stride,
                              int64_t scale_stride, int64_t start, const std::vector<TreeChain>& chains, const T* new_keys,
                              int64_t key_stride, const T* new_values, int64_t value_stride, T* out) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "tree attention over an int8 cache: needs AVX512-VNNI");
  check_tree_rows(tokens, H, D, KV, L, start);
  if (tokens == 0) return;
  const float softmax_scale = 1.0f / std::sqrt(float(D));
  std::vector<int8_t> codes(size_t(tokens * H * D));
  std::vector<float> scales(size_t(tokens * H));
  std::vector<int32_t> offsets(size_t(tokens * H));
  quantize_queries(q, tokens * H, D, codes.data(), scales.data(), offsets.data());
  const bool tiles = amx_int8_scores_chosen(D);
  with_head_dim(D, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    attend_tree<kD>(tokens, H, KV, start, chains, out,
        [&](int64_t first, int64_t position, int64_t count) {
          return Int8Rows{Rows<int8_t>{codes.data() + first * H * D, position, count, H / KV, H, D, softmax_scale},
                          scales.data() + first * H, offsets.data() + first * H, tiles};
        },
        [&](const Int8Rows& rows, int64_t h, int64_t first, int64_t last, int64_t c, float* into) {
          int8_chunk_partials<kD>(rows, h, first, last, c, keys + h * head_stride, values + h * head_stride,
                                  key_scales + h * scale_stride, value_scales + h * scale_stride, into);
        },
        [&](int64_t h, const TreeChain& chain) {
          for (size_t i = 0; i < chain.path.size(); ++i)
            quantize_kv_row(new_keys + chain.path[i] * key_stride + h * D, new_values + chain.path[i] * value_stride + h * D,
                            keys, values, key_scales, value_scales, h * head_stride + (start + int64_t(i)) * D,
                            h * scale_stride + start + int64_t(i), D);
        });
  });
}
template void tree_attention_int8_into<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, int64_t, uint8_t*, int8_t*, float*,
                                                     float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                     const std::vector<TreeChain>&, const at::BFloat16*, int64_t,
                                                     const at::BFloat16*, int64_t, at::BFloat16*);
template void tree_attention_int8_into<float>(const float*, int64_t, int64_t, int64_t, uint8_t*, int8_t*, float*, float*,
                                              int64_t, int64_t, int64_t, int64_t, int64_t, const std::vector<TreeChain>&,
                                              const float*, int64_t, const float*, int64_t, float*);
