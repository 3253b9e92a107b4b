// Weight-only int4 and int8 matmuls with integer dot products: y[M, N] = x[M, K] . W[N, K]^T.
//
// Why: torch's CPU kernels for quantized weights (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm)
// dequantize to floats and compute row by row: a decode row costs ~2.5x what these do, and 8
// verification rows or a prefill chunk pay per row. Here x is quantized to int8 per row and group
// of 32 inputs (x ~ x_scale * q_x, the way llama.cpp quantizes activations) and each group's
// dot product is an exact int32 sum: AVX512-VNNI's vpdpbusd for few rows, AMX's tdpbsud (a
// 16-row tile at once) for many rows where the CPU has AMX, and on CPUs without AVX512-VNNI AVX2's
// vpmaddubsw/vpmaddwd (8 channels at a time, no AVX512 instruction; see "AVX2" below). Chosen per
// call (choose_isa); DFLASH_INT8DOT_ISA=avx2 forces AVX2 here too, for tests and benches.
//
// Row invariance (see model.py) holds by construction: integer sums are exact whichever
// instruction and blocking computed them, and the float epilogue that applies the scales is one
// fixed sequence per row and group. So a verified row equals a decoded row bit for bit, prefill rows
// equal them too, and the three kernels agree exactly (tests/model/test_quantized_kernels.py).
//
// Layouts (made by quant.py), per block of 16 output channels and group g of 32 inputs, in 4-byte
// quads: quad t, byte 4j+i holds the code of channel n0+j, input k0+4t+i (AMX's B-tile layout too):
//   int4: [N/16, K/32, 4, 64] uint8: chunk c holds quad 2c in its low nibbles and 2c+1 in its high
//         ones; scales [N/16, K/32, 2, 16] bf16: scale and zero (w = (q - 8) * scale + zero).
//   int8: [N/16, K/32, 8, 64] uint8 holding q + 128; scales [N] fp32 (w = q * scale).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"
#include "step_pool.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kChannels = 16;  // output channels per block: one vector of 16 int32/fp32
constexpr int64_t kGroup = 32;     // inputs per group of scales
constexpr int64_t kTileRows = 16;  // rows of x per AMX tile
// Fewer rows run on VNNI. int8: tiles pay from 5 rows. int4: VNNI unpacks a group's nibbles into
// registers, tiles need them stored and each 32-input group's sums stored and reloaded for its
// float epilogue; measured on a Sapphire Rapids-class AMX VM (one thread, the embedded model's 30 layers):
// 8 rows 7.3 ms on VNNI against 11.2 on tiles, 32 rows 23.5 against 25.3, 128 rows 86 against 83.
// Since amx_blocks unpacks each block once a call and keeps a row tile's totals in L1 (the same VM,
// the 30 layers' four linears, one thread): 24 rows 16.8-17.0 ms on VNNI against 17.3-17.4 on tiles,
// 32 rows 22.0-22.2 against 19.5-20.4, 48 rows 32.3-32.4 against 27.0-27.1 (2 threads: 32 rows
// 19.8-20.1 against 19.0-19.4).
constexpr int64_t kAmxFromRows = 5;
constexpr int64_t kInt4AmxFromRows = 32;

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#define AVX2_TARGET __attribute__((target("avx2,fma")))  // no AVX512 instruction may appear under it

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_amx_int8() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8");
}

bool request_amx_permission() {
  // Linux hands out the AMX register state only to a process that asks (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); without it the first tile instruction is SIGILL.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

VNNI_TARGET inline __m512 bf16_to_fp32(const void* sixteen_bf16) {
  auto wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(sixteen_bf16)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// fp32 -> bf16, rounding to nearest even (what vcvtneps2bf16 does for numbers), on any AVX512 CPU.
VNNI_TARGET inline void store_bf16(at::BFloat16* out, __m512 values) {
  __m512i bits = _mm512_castps_si512(values);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

struct QuantizedRows {  // x [M, K] as int8 per group of 32: x ~ scale * q
  int64_t K, groups;
  std::vector<int8_t> q;       // [rows, K], rows padded with zeros to a multiple of 16 for AMX
  std::vector<float> scale;    // [M, K/32]
  std::vector<int32_t> total;  // [M, K/32]: the sum of q over the group
  std::vector<float> total_float;  // the same sums as floats (exact: |sum| <= 32 * 127), for int4_group
  const int8_t* row(int64_t m, int64_t g) const { return q.data() + m * K + g * kGroup; }
};

VNNI_TARGET QuantizedRows quantize_rows(const at::BFloat16* x, int64_t M, int64_t padded_rows, int64_t K) {
  const int64_t groups = K / kGroup;
  QuantizedRows out{K, groups, std::vector<int8_t>(padded_rows * K), std::vector<float>(M * groups),
                    std::vector<int32_t>(M * groups), std::vector<float>(M * groups)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const auto* p = x + m * K + g * kGroup;
      __m512 low = bf16_to_fp32(p), high = bf16_to_fp32(p + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      __m512 inverse = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));  // round to nearest even
      __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
      int8_t* q = out.q.data() + m * K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q_low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q_high));
      out.scale[m * groups + g] = amax / 127.0f;
      out.total[m * groups + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
      out.total_float[m * groups + g] = float(out.total[m * groups + g]);
    }
  }
  return out;
}

// The epilogues, shared by both kernels so that their rows agree bit for bit. `dot` is the int32
// sum over one group of 16 channels.
VNNI_TARGET inline __m512 int4_group(__m512 total, __m512i dot, __m512 scale, __m512 offset, const QuantizedRows& x,
                                     int64_t m, int64_t g) {
  // sum_k x_k w_k = x_scale * (scale * sum q_x q_w + offset * sum q_x), w = q_w * scale + offset
  const int64_t at = m * x.groups + g;
  __m512 group = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, _mm512_mul_ps(offset, _mm512_set1_ps(x.total_float[at])));
  return _mm512_fmadd_ps(group, _mm512_set1_ps(x.scale[at]), total);
}

VNNI_TARGET inline __m512 int8_group(__m512 total, __m512i dot_of_offset_codes, const QuantizedRows& x, int64_t m,
                                     int64_t g) {
  const int64_t at = m * x.groups + g;  // the codes were stored + 128: take 128 * sum q_x back
  __m512i dot = _mm512_sub_epi32(dot_of_offset_codes, _mm512_set1_epi32(128 * x.total[at]));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x.scale[at]), total);
}

VNNI_TARGET inline void int4_group_scales(const at::BFloat16* scales, __m512& scale, __m512& offset) {
  scale = bf16_to_fp32(scales);
  offset = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), scale, bf16_to_fp32(scales + 16));  // w = q * scale + offset
}

VNNI_TARGET inline __m512i quad(const int8_t* q) {  // 4 int8 broadcast to every lane
  int32_t bits;
  std::memcpy(&bits, q, 4);
  return _mm512_set1_epi32(bits);
}

// gcc -O2 keeps short loops over rows as loops, with the accumulators (and the VNNI kernels' unpacked
// weights) in memory: unroll them. Measured on Zen 4 before the VNNI loops were: each group's 8
// weight vectors went through the stack, and 8 rows ran one dependent vpdpbusd after another.
#define UNROLLED _Pragma("GCC unroll 8")

// ----- VNNI: one block of 16 channels over rows [m0, m0 + Rows), weights kept in registers -----

// The int32 sums over group g of 32 inputs for 16 channels, of rows m0 .. m0 + Rows - 1. With one or
// two rows a pass has too few independent vpdpbusd chains to hide the instruction's latency (5
// cycles), so each row's group runs as two chains added at the end. With more, the rows' chains
// are interleaved quad by quad: written row after row, each row a chain of 8 dependent vpdpbusd, the
// core had to look ahead past several rows' chains and epilogues to overlap them, and an 8-row pass
// ran at ~100 cycles a group where its 64 vpdpbusd need 32 (this VM issues two a cycle). Integer
// sums: the same bits whatever the order.
template <int Rows>
VNNI_TARGET inline void group_dots(const __m512i* w, const QuantizedRows& x, int64_t m0, int64_t g, __m512i* dots) {
  if constexpr (Rows <= 2) {
    UNROLLED for (int r = 0; r < Rows; ++r) {
      const int8_t* q = x.row(m0 + r, g);
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      UNROLLED for (int t = 0; t < 8; t += 2) {
        even = _mm512_dpbusd_epi32(even, w[t], quad(q + 4 * t));
        odd = _mm512_dpbusd_epi32(odd, w[t + 1], quad(q + 4 * t + 4));
      }
      dots[r] = _mm512_add_epi32(even, odd);
    }
  } else {
    UNROLLED for (int r = 0; r < Rows; ++r) dots[r] = _mm512_setzero_si512();
    UNROLLED for (int t = 0; t < 8; ++t) {
      UNROLLED for (int r = 0; r < Rows; ++r) dots[r] = _mm512_dpbusd_epi32(dots[r], w[t], quad(x.row(m0 + r, g) + 4 * t));
    }
  }
}

template <int Rows>
VNNI_TARGET void int4_vnni(const QuantizedRows& x, int64_t m0, const uint8_t* codes, const at::BFloat16* scales,
                           at::BFloat16* y, int64_t N, int64_t block) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 totals[Rows];
  UNROLLED for (int r = 0; r < Rows; ++r) totals[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const int64_t tile = block * x.groups + g;
    if constexpr (Rows >= 4) {  // several rows spend ~100 cycles a group: fetch 4 groups ahead (8 rows: -10%, Zen 4)
      UNROLLED for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(codes + (tile + 4) * 256 + 64 * c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scales + (tile + 4) * 32), _MM_HINT_T0);
    }
    __m512i w[8];
    UNROLLED for (int c = 0; c < 4; ++c) {
      __m512i bytes = _mm512_loadu_si512(codes + tile * 256 + 64 * c);
      w[2 * c] = _mm512_and_si512(bytes, nibble);
      w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    }
    __m512 scale, offset;
    int4_group_scales(scales + tile * 32, scale, offset);
    __m512i dots[Rows];
    group_dots<Rows>(w, x, m0, g, dots);
    UNROLLED for (int r = 0; r < Rows; ++r) totals[r] = int4_group(totals[r], dots[r], scale, offset, x, m0 + r, g);
  }
  UNROLLED for (int r = 0; r < Rows; ++r) store_bf16(y + (m0 + r) * N + block * kChannels, totals[r]);
}

template <int Rows>
VNNI_TARGET void int8_vnni(const QuantizedRows& x, int64_t m0, const uint8_t* codes, const float* scales,
                           at::BFloat16* y, int64_t N, int64_t block) {
  __m512 totals[Rows];
  UNROLLED for (int r = 0; r < Rows; ++r) totals[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const uint8_t* packed = codes + (block * x.groups + g) * 512;
    __m512i w[8];
    UNROLLED for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(packed + 64 * t);
    __m512i dots[Rows];
    group_dots<Rows>(w, x, m0, g, dots);
    UNROLLED for (int r = 0; r < Rows; ++r) totals[r] = int8_group(totals[r], dots[r], x, m0 + r, g);
  }
  const __m512 scale = _mm512_loadu_ps(scales + block * kChannels);
  UNROLLED for (int r = 0; r < Rows; ++r) store_bf16(y + (m0 + r) * N + block * kChannels, _mm512_mul_ps(totals[r], scale));
}

// Rows in passes of up to MaxRows (a group's weights are loaded, and int4 ones unpacked, once per
// pass): 8 on AVX512 (32 registers hold 8 rows' totals beside the weights), 4 on AVX2 (16). The
// rows left after the full passes run as one pass (7 rows as 4 + 2 + 1 unpacked each group three
// times: 7 rows cost as much as 8 on Zen 4, and the int8 LM head over a DFlash block's 7 more).
template <int N, typename Kernel>
void one_pass(int64_t rows, Kernel& kernel, int64_t m0) {  // a pass of `rows` (1..N) rows from m0
  if constexpr (N > 1) {
    if (rows < N) return one_pass<N - 1>(rows, kernel, m0);
  }
  kernel(std::integral_constant<int, N>{}, m0);
}

template <int MaxRows, typename Kernel>
void row_passes(int64_t M, Kernel kernel) {
  for (int64_t m0 = 0; m0 < M; m0 += MaxRows) one_pass<MaxRows>(std::min<int64_t>(MaxRows, M - m0), kernel, m0);
}

// ----- AVX2 (CPUs without AVX512-VNNI): the same int32 sums and the same epilogue on 8 lanes -----
//
// Every step above is lane-wise per output channel, so a block of 16 channels runs as two halves of
// 8 with the same fp32 operations in the same order (fma where fma, mul where mul); the integer
// sums come from vpmaddubsw (u8 codes x s8 activations, pairs summed into int16) and vpmaddwd.
// Codes are split into nibbles 0..15, so a pair is at most 2 * 15 * 128 = 3840 in magnitude and
// 8 of them (one group) still fit an int16 exactly: no saturation anywhere, the sums are exact.

AVX2_TARGET inline __m256 bf16_to_fp32_avx2(const void* eight_bf16) {
  auto wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(eight_bf16)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

AVX2_TARGET inline void store_bf16_avx2(at::BFloat16* out, __m256 values) {  // 8 values, as store_bf16
  __m256i bits = _mm256_castps_si256(values);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  // packus: [0-3, 0-3 | 4-7, 4-7] as 16-bit (values are 0..0xFFFF: no saturation); keep qwords 0 and 2
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

AVX2_TARGET inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

AVX2_TARGET inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// quantize_rows on AVX2: the same amax, the same 127 / amax multiply, the same rounding (to
// nearest even), saturation and sums, so the same codes and scales.
AVX2_TARGET QuantizedRows quantize_rows_avx2(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  QuantizedRows out{K, groups, std::vector<int8_t>(M * K), std::vector<float>(M * groups),
                    std::vector<int32_t>(M * groups), std::vector<float>(M * groups)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const auto* p = x + m * K + g * kGroup;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = bf16_to_fp32_avx2(p + 8 * i);
      float amax = max_of(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude))));
      __m256 inverse = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
      // packs: dwords of bytes come out as inputs [0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23, 28-31]
      __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + m * K + g * kGroup),
                          _mm256_permutevar8x32_epi32(bytes, in_order));
      out.scale[m * groups + g] = amax / 127.0f;
      out.total[m * groups + g] = sum_of(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      out.total_float[m * groups + g] = float(out.total[m * groups + g]);
    }
  }
  return out;
}

AVX2_TARGET inline __m256 int4_group_avx2(__m256 total, __m256i dot, __m256 scale, __m256 offset,
                                          const QuantizedRows& x, int64_t m, int64_t g) {  // int4_group
  const int64_t at = m * x.groups + g;
  __m256 group = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, _mm256_mul_ps(offset, _mm256_set1_ps(x.total_float[at])));
  return _mm256_fmadd_ps(group, _mm256_set1_ps(x.scale[at]), total);
}

AVX2_TARGET inline __m256 int8_group_avx2(__m256 total, __m256i dot_of_offset_codes, const QuantizedRows& x,
                                          int64_t m, int64_t g) {  // int8_group
  const int64_t at = m * x.groups + g;
  __m256i dot = _mm256_sub_epi32(dot_of_offset_codes, _mm256_set1_epi32(128 * x.total[at]));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(x.scale[at]), total);
}

AVX2_TARGET inline __m256i quad_avx2(const int8_t* q) {  // 4 int8 broadcast to every lane
  int32_t bits;
  std::memcpy(&bits, q, 4);
  return _mm256_set1_epi32(bits);
}

// int4 codes 6 KB ahead of a block's group are fetched while it is computed (half 0 reads a tile
// first; half 1 finds it in L1). Why: with a few rows the cores waited on memory between tiles
// (AMD EPYC Zen 2, 2 threads, the embedded model in int4 at 300 of context, medians of 5 runs
// alternated: a 1+1-row verification 8.47 -> 7.58 ms; 1+3 rows ~5% less; a decode step and
// prefill the same within noise). The same for the int8 kernels (the LM head) cost that gain back.
constexpr int64_t kPrefetchTiles = 24;

AVX2_TARGET inline void prefetch_int4_tile(const uint8_t* codes, const at::BFloat16* scales, int64_t tile) {
  const char* ahead = reinterpret_cast<const char*>(codes + (tile + kPrefetchTiles) * 256);
  for (int line = 0; line < 256; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + (tile + kPrefetchTiles) * 32), _MM_HINT_T0);
}

// One half (channels 8 half .. 8 half + 7) of a block over rows [m0, m0 + Rows). A 64-byte chunk
// of codes holds the 16 channels; its bytes 32 half .. 32 half + 31 are this half's.
template <int Rows>
AVX2_TARGET void int4_avx2(const QuantizedRows& x, int64_t m0, const uint8_t* codes, const at::BFloat16* scales,
                           at::BFloat16* y, int64_t N, int64_t block, int half) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 totals[Rows];
  UNROLLED for (int r = 0; r < Rows; ++r) totals[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const int64_t tile = block * x.groups + g;
    const uint8_t* packed = codes + tile * 256 + 32 * half;
    if (half == 0) prefetch_int4_tile(codes, scales, tile);
    __m256i sums[Rows];  // int16 pairs: at most 8 * 3840 in magnitude
    UNROLLED for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // chunk c: quad 2c in the low nibbles, 2c + 1 in the high ones
      __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64 * c));
      __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      UNROLLED for (int r = 0; r < Rows; ++r) {
        const int8_t* q = x.row(m0 + r, g) + 8 * c;
        sums[r] = _mm256_add_epi16(sums[r], _mm256_add_epi16(_mm256_maddubs_epi16(low, quad_avx2(q)),
                                                             _mm256_maddubs_epi16(high, quad_avx2(q + 4))));
      }
    }
    const at::BFloat16* group_scales = scales + tile * 32 + 8 * half;
    __m256 scale = bf16_to_fp32_avx2(group_scales);
    __m256 offset = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), scale, bf16_to_fp32_avx2(group_scales + 16));
    UNROLLED for (int r = 0; r < Rows; ++r)
      totals[r] = int4_group_avx2(totals[r], _mm256_madd_epi16(sums[r], ones), scale, offset, x, m0 + r, g);
  }
  UNROLLED for (int r = 0; r < Rows; ++r) store_bf16_avx2(y + (m0 + r) * N + block * kChannels + 8 * half, totals[r]);
}

// int8 codes (q + 128, 0..255) as 16 * high nibble + low nibble: the int32 is VNNI's sum over
// (q + 128) * q_x exactly, and int8_group takes the 128 * sum q_x back the same way. Splitting the
// codes costs 3 instructions per 32 bytes, shared by the rows: used for passes of 4 rows.
template <int Rows>
AVX2_TARGET void int8_avx2(const QuantizedRows& x, int64_t m0, const uint8_t* codes, const float* scales,
                           at::BFloat16* y, int64_t N, int64_t block, int half) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  __m256 totals[Rows];
  UNROLLED for (int r = 0; r < Rows; ++r) totals[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const uint8_t* packed = codes + (block * x.groups + g) * 512 + 32 * half;
    __m256i low_sums[Rows], high_sums[Rows];
    UNROLLED for (int r = 0; r < Rows; ++r) low_sums[r] = high_sums[r] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64 * t));
      __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      UNROLLED for (int r = 0; r < Rows; ++r) {
        __m256i q = quad_avx2(x.row(m0 + r, g) + 4 * t);
        low_sums[r] = _mm256_add_epi16(low_sums[r], _mm256_maddubs_epi16(low, q));
        high_sums[r] = _mm256_add_epi16(high_sums[r], _mm256_maddubs_epi16(high, q));
      }
    }
    UNROLLED for (int r = 0; r < Rows; ++r) {
      __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(high_sums[r], sixteen), _mm256_madd_epi16(low_sums[r], ones));
      totals[r] = int8_group_avx2(totals[r], dot, x, m0 + r, g);
    }
  }
  const __m256 scale = _mm256_loadu_ps(scales + block * kChannels + 8 * half);
  UNROLLED for (int r = 0; r < Rows; ++r)
    store_bf16_avx2(y + (m0 + r) * N + block * kChannels + 8 * half, _mm256_mul_ps(totals[r], scale));
}

// int8 codes as signed q (codes ^ 0x80) and llama.cpp's sign trick: |q_x| (u8) x sign(q, q_x)
// (s8) is q q_x, a pair at most 2 * 128 * 127 in magnitude (no saturation), summed to int32 per
// quad; 128 * sum q_x added back gives VNNI's sum over (q + 128) q_x exactly. One more instruction
// per row and quad than the nibble split but less shared work: 5-15% faster for passes of 1 or 2
// rows, 5% slower for 4 (measured).
template <int Rows>
AVX2_TARGET void int8_avx2_sign(const QuantizedRows& x, int64_t m0, const uint8_t* codes, const float* scales,
                                at::BFloat16* y, int64_t N, int64_t block, int half) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 totals[Rows];
  UNROLLED for (int r = 0; r < Rows; ++r) totals[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const uint8_t* packed = codes + (block * x.groups + g) * 512 + 32 * half;
    __m256i sums[Rows];
    UNROLLED for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64 * t)), flip);
      UNROLLED for (int r = 0; r < Rows; ++r) {
        __m256i q_x = quad_avx2(x.row(m0 + r, g) + 4 * t);
        __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q_x), _mm256_sign_epi8(q, q_x));
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, ones));
      }
    }
    UNROLLED for (int r = 0; r < Rows; ++r) {
      __m256i dot = _mm256_add_epi32(sums[r], _mm256_set1_epi32(128 * x.total[(m0 + r) * x.groups + g]));
      totals[r] = int8_group_avx2(totals[r], dot, x, m0 + r, g);
    }
  }
  const __m256 scale = _mm256_loadu_ps(scales + block * kChannels + 8 * half);
  UNROLLED for (int r = 0; r < Rows; ++r)
    store_bf16_avx2(y + (m0 + r) * N + block * kChannels + 8 * half, _mm256_mul_ps(totals[r], scale));
}

// ----- AMX: 16 rows x 16 channels per tile, tdpbsud (signed x, unsigned codes) per group -----

// tmm0-3: int32 sums of four channel blocks (`rows` x 16), tmm4: x (`rows` x 32 int8),
// tmm5-7: codes (8 quads x 64 bytes), the fourth block reusing tmm5.
AMX_TARGET void load_tile_config(int rows) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.shape(t, rows, 64);
  config.shape(4, rows, kGroup);
  for (int t = 5; t < 8; ++t) config.shape(t, kGroup / 4, 64);
  load_tiles(config);
}

template <int Tile>
AMX_TARGET inline void multiply_block(const uint8_t* codes) {  // tmm{Tile} += tmm4 . codes
  if constexpr (Tile == 0) { _tile_loadd(5, codes, 64); _tile_dpbsud(0, 4, 5); }
  if constexpr (Tile == 1) { _tile_loadd(6, codes, 64); _tile_dpbsud(1, 4, 6); }
  if constexpr (Tile == 2) { _tile_loadd(7, codes, 64); _tile_dpbsud(2, 4, 7); }
  if constexpr (Tile == 3) { _tile_loadd(5, codes, 64); _tile_dpbsud(3, 4, 5); }
}

template <int Blocks>
AMX_TARGET inline void group_tiles(const int8_t* x, int64_t stride, const uint8_t* const* codes, int32_t* sums) {
  _tile_zero(0);
  if constexpr (Blocks > 1) _tile_zero(1);
  if constexpr (Blocks > 2) _tile_zero(2);
  if constexpr (Blocks > 3) _tile_zero(3);
  _tile_loadd(4, x, stride);
  multiply_block<0>(codes[0]);
  if constexpr (Blocks > 1) multiply_block<1>(codes[1]);
  if constexpr (Blocks > 2) multiply_block<2>(codes[2]);
  if constexpr (Blocks > 3) multiply_block<3>(codes[3]);
  _tile_stored(0, sums, 64);
  if constexpr (Blocks > 1) _tile_stored(1, sums + 256, 64);
  if constexpr (Blocks > 2) _tile_stored(2, sums + 512, 64);
  if constexpr (Blocks > 3) _tile_stored(3, sums + 768, 64);
}

VNNI_TARGET inline void unpack_int4(const uint8_t* packed, uint8_t* codes) {  // 256 bytes -> 8 quads of 64
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    __m512i bytes = _mm512_loadu_si512(packed + 64 * c);
    _mm512_store_si512(codes + 128 * c, _mm512_and_si512(bytes, nibble));
    _mm512_store_si512(codes + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
  }
}

// Channel blocks first .. first + Blocks over all rows (padded to 16 in x.q; `M` real ones).
// `unpacked` groups x 4 x 512 bytes, `group_scales` and `group_offsets` groups x 4 x 16 fp32, `sums`
// 4 x 256 int32: scratch. Each block's codes are unpacked (int4) and its group scales read once per
// call, then each tile of 16 rows runs every group with its totals in L1 (4 x 16 x 16 fp32). Before,
// groups ran outermost and every row's totals went through memory once a group: for 256 rows 64 KB,
// L2, so a prefill chunk's int4 matmuls spent their time in that epilogue (perf, AMX VM). Each total
// takes the same operations in the same order (group by group), so the same bits.
template <int Blocks, bool Int4>
AMX_TARGET void amx_blocks(const QuantizedRows& x, int64_t M, const uint8_t* codes, const void* scales,
                           at::BFloat16* y, int64_t N, int64_t first, uint8_t* unpacked, float* group_scales,
                           float* group_offsets, int32_t* sums) {
  const int64_t rows = std::min<int64_t>(M, kTileRows);
  for (int64_t g = 0; g < x.groups; ++g) {
    for (int b = 0; b < Blocks; ++b) {
      const int64_t tile = (first + b) * x.groups + g;
      if constexpr (Int4) {
        unpack_int4(codes + tile * 256, unpacked + (g * 4 + b) * 512);
        __m512 scale, offset;
        int4_group_scales(static_cast<const at::BFloat16*>(scales) + tile * 32, scale, offset);
        _mm512_store_ps(group_scales + (g * 4 + b) * kChannels, scale);
        _mm512_store_ps(group_offsets + (g * 4 + b) * kChannels, offset);
      }
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    alignas(64) float totals[4][kTileRows][kChannels];
    const int64_t here = std::min<int64_t>(rows, M - m0);
    for (int b = 0; b < Blocks; ++b)
      for (int64_t r = 0; r < here; ++r) _mm512_store_ps(totals[b][r], _mm512_setzero_ps());
    for (int64_t g = 0; g < x.groups; ++g) {
      const uint8_t* tiles[4];
      for (int b = 0; b < Blocks; ++b) tiles[b] = Int4 ? unpacked + (g * 4 + b) * 512 : codes + ((first + b) * x.groups + g) * 512;
      group_tiles<Blocks>(x.row(m0, g), x.K, tiles, sums);
      for (int64_t r = 0; r < here; ++r) {
        for (int b = 0; b < Blocks; ++b) {
          __m512i dot = _mm512_load_si512(sums + b * 256 + r * kChannels);
          __m512 updated = Int4 ? int4_group(_mm512_load_ps(totals[b][r]), dot, _mm512_load_ps(group_scales + (g * 4 + b) * kChannels),
                                             _mm512_load_ps(group_offsets + (g * 4 + b) * kChannels), x, m0 + r, g)
                                : int8_group(_mm512_load_ps(totals[b][r]), dot, x, m0 + r, g);
          _mm512_store_ps(totals[b][r], updated);
        }
      }
    }
    for (int b = 0; b < Blocks; ++b) {
      const __m512 scale_out = Int4 ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(static_cast<const float*>(scales) + (first + b) * kChannels);
      for (int64_t r = 0; r < here; ++r) {
        const __m512 total = _mm512_load_ps(totals[b][r]);
        store_bf16(y + (m0 + r) * N + (first + b) * kChannels, Int4 ? total : _mm512_mul_ps(total, scale_out));
      }
    }
  }
}

template <typename T>
struct Aligned {  // 64-byte aligned scratch
  std::vector<T> storage;
  explicit Aligned(size_t count) : storage(count + 64 / sizeof(T)) {}
  T* get() { return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63)); }
};

template <bool Int4>
void amx_matmul(const QuantizedRows& x, int64_t M, const uint8_t* codes, const void* scales, at::BFloat16* y,
                int64_t N) {
  step_pool::parallel_for(N / kChannels, 4, [&](int64_t begin, int64_t end) {
    Aligned<uint8_t> unpacked(Int4 ? x.groups * 4 * 512 : 0);
    Aligned<float> group_scales(Int4 ? x.groups * 4 * kChannels : 0), group_offsets(Int4 ? x.groups * 4 * kChannels : 0);
    Aligned<int32_t> sums(4 * 256);
    load_tile_config(std::min<int64_t>(M, kTileRows));
    for (int64_t block = begin; block < end; block += 4) {
      switch (std::min<int64_t>(4, end - block)) {
        case 4: amx_blocks<4, Int4>(x, M, codes, scales, y, N, block, unpacked.get(), group_scales.get(), group_offsets.get(), sums.get()); break;
        case 3: amx_blocks<3, Int4>(x, M, codes, scales, y, N, block, unpacked.get(), group_scales.get(), group_offsets.get(), sums.get()); break;
        case 2: amx_blocks<2, Int4>(x, M, codes, scales, y, N, block, unpacked.get(), group_scales.get(), group_offsets.get(), sums.get()); break;
        default: amx_blocks<1, Int4>(x, M, codes, scales, y, N, block, unpacked.get(), group_scales.get(), group_offsets.get(), sums.get());
      }
    }
    release_tiles();
  }, M * N * x.K >= step_pool::kWorthWakingMacs);
}

enum class Isa { kAvx2, kVnni, kAmx };

Isa choose_isa(int64_t M, bool int4);

void check_arguments(const at::Tensor& x, const at::Tensor& codes, int64_t bytes_per_group, const char* name) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) * codes.size(3) == bytes_per_group && codes.is_contiguous(), name,
              ": codes are not in quant.py's layout: ", codes.sizes());
  const int64_t K = codes.size(1) * kGroup;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == K, name, ": expected x [M, ", K,
              "] bf16, got ", x.sizes(), " ", x.scalar_type());
}

// y [M, N] = x [M, K] . W^T, bf16 rows in and out (contiguous), W in quant.py's layout.
void quantized_matmul_rows(const at::BFloat16* values, int64_t M, int64_t K, const uint8_t* packed, const void* scales,
                           int64_t N, bool int4, at::BFloat16* out) {
  const Isa isa = choose_isa(M, int4);
  const int64_t padded = isa == Isa::kAmx ? (M + kTileRows - 1) / kTileRows * kTileRows : M;
  const QuantizedRows rows = isa == Isa::kAvx2 ? quantize_rows_avx2(values, M, K) : quantize_rows(values, M, padded, K);
  if (isa == Isa::kAmx) {
    if (int4) amx_matmul<true>(rows, M, packed, static_cast<const at::BFloat16*>(scales), out, N);
    else amx_matmul<false>(rows, M, packed, static_cast<const float*>(scales), out, N);
    return;
  }
  step_pool::parallel_for(N / kChannels, 8, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      if (int4 && isa == Isa::kVnni) {
        row_passes<8>(M, [&](auto rows_per_pass, int64_t m0) {
          int4_vnni<decltype(rows_per_pass)::value>(rows, m0, packed, static_cast<const at::BFloat16*>(scales), out, N, block);
        });
      } else if (int4) {
        row_passes<4>(M, [&](auto rows_per_pass, int64_t m0) {
          constexpr int kRows = decltype(rows_per_pass)::value;
          const auto* group_scales = static_cast<const at::BFloat16*>(scales);
          for (int half = 0; half < 2; ++half) int4_avx2<kRows>(rows, m0, packed, group_scales, out, N, block, half);
        });
      } else if (isa == Isa::kVnni) {
        row_passes<8>(M, [&](auto rows_per_pass, int64_t m0) {
          int8_vnni<decltype(rows_per_pass)::value>(rows, m0, packed, static_cast<const float*>(scales), out, N, block);
        });
      } else {
        row_passes<4>(M, [&](auto rows_per_pass, int64_t m0) {
          constexpr int kRows = decltype(rows_per_pass)::value;
          const auto* channel_scales = static_cast<const float*>(scales);
          for (int half = 0; half < 2; ++half) {  // measured: the sign trick is faster for 1-2 rows
            if constexpr (kRows < 4) int8_avx2_sign<kRows>(rows, m0, packed, channel_scales, out, N, block, half);
            else int8_avx2<kRows>(rows, m0, packed, channel_scales, out, N, block, half);
          }
        });
      }
    }
  }, M * N * K >= step_pool::kWorthWakingMacs);
}

at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool int4) {
  const int64_t N = codes.size(0) * kChannels, K = codes.size(1) * kGroup, M = x.size(0);
  auto input = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  quantized_matmul_rows(input.data_ptr<at::BFloat16>(), M, K, codes.data_ptr<uint8_t>(),
                        int4 ? static_cast<const void*>(scales.data_ptr<at::BFloat16>()) : scales.data_ptr<float>(), N, int4,
                        y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace

bool vnni_available() {
  static const bool available = cpu_has_vnni();
  return available;
}

bool int8dot_available() {  // AVX2 and FMA: every AVX512-VNNI CPU has them too
  static const bool available = cpu_has_avx2();
  return available;
}

bool amx_available() {
  static const bool available = vnni_available() && cpu_has_amx_int8() && request_amx_permission();
  return available;
}

namespace {
bool amx_allowed() {
  static const bool allowed = std::getenv("DFLASH_AMX") == nullptr || std::string(std::getenv("DFLASH_AMX")) != "0";
  return allowed && amx_available();
}

// Per call: AMX where present from 5 rows (int8) or 64 (int4), else AVX512-VNNI, else AVX2.
// DFLASH_INT8DOT_ISA=avx2 (or =vnni: no AMX; =amx: AMX for any row count where present) forces one,
// read on every call so tests can compare all three in one process; the results are the same bit
// for bit whichever runs.
Isa choose_isa(int64_t M, bool int4) {
  const char* forced = std::getenv("DFLASH_INT8DOT_ISA");
  const std::string wanted = forced == nullptr ? "" : forced;
  if (wanted == "avx2" || !vnni_available()) return Isa::kAvx2;
  if (wanted == "vnni" || !amx_allowed()) return Isa::kVnni;
  if (wanted == "amx") return Isa::kAmx;
  return M >= (int4 ? kInt4AmxFromRows : kAmxFromRows) ? Isa::kAmx : Isa::kVnni;
}
}  // namespace

// What a call with `rows` rows (of int4 weights or int8 ones) runs on here: "amx", "avx512-vnni",
// "avx2" (or "none": no AVX2).
std::string int8dot_isa(int64_t rows, bool int4) {
  if (!int8dot_available()) return "none";
  switch (choose_isa(rows, int4)) {
    case Isa::kAmx: return "amx";
    case Isa::kVnni: return "avx512-vnni";
    default: return "avx2";
  }
}

// The kernels on raw rows, for decode_layers' loop without ATen calls: x [M, K] bf16 contiguous,
// codes and scales as below (contiguous, checked once by the caller), y [M, N] bf16.
void quantized_matmul_into(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const void* scales, int64_t N,
                           bool int4, at::BFloat16* y) {
  quantized_matmul_rows(x, M, K, codes, scales, N, int4, y);
}

// x [M, K] bf16, codes [N/16, K/32, 4, 64] uint8, scales [N/16, K/32, 2, 16] bf16 -> [M, N] bf16.
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(int8dot_available(), "int4_matmul: this CPU has no AVX2");
  check_arguments(x, codes, 256, "int4_matmul");
  return quantized_matmul(x, codes, scales, true);
}

// x [M, K] bf16, codes [N/16, K/32, 8, 64] uint8 (q + 128), scales [N] fp32 -> [M, N] bf16.
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(int8dot_available(), "int8_matmul: this CPU has no AVX2");
  check_arguments(x, codes, 512, "int8_matmul");
  return quantized_matmul(x, codes, scales, false);
}
