// The decoder layers of a decode step or a verification block (few rows) in one C++ call.
//
// Why: a decode step of a small model is ~1000 small ATen calls, and from Python each costs a few
// microseconds of interpreter and argument parsing on top of the kernel. This file makes exactly
// the calls model.py makes, in the same order with the same shapes and dtypes, so its results are
// bit-identical to the Python path (tests/model/test_native.py) and only the overhead goes.
#include <torch/extension.h>

#include "step_pool.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

// quantized_linear.cpp
bool vnni_available();
bool amx_available();
bool int8dot_available();
std::string int8dot_isa(int64_t rows);
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
// causal_attention.cpp
bool causal_attention_available();
std::string causal_attention_isa();
int64_t causal_attention_revision();
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start);
bool int8_kv_available();
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

// model.RMSNorm over the last dimension, row by row in one fixed order (so a row's result does not
// depend on the other rows): normed = dtype(x * 1/sqrt(mean(x^2) + eps)) in fp32, out = dtype(weight * normed).
// torch's rms_norm costs ~30 us per call here (it runs as a chain of ops), a decode step makes 61.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t C, float eps) {
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
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const T* in = x.data_ptr<T>();
  const T *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for (int64_t t = 0; t < rows; ++t) {
    const T* ct = c + t * cos.stride(0);
    const T* st = s + t * sin.stride(0);
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = in + t * x.stride(0) + h * x.stride(1);
      T* orow = o + (t * heads + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const T rotated = xr[d < half ? d + half : d - half];
        orow[d] = T(float(T(float(xr[d]) * float(ct[d]))) + float(T(float(rotated) * float(st[d]))));
      }
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
    int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, const std::vector<int64_t>& capture) {
  at::NoGradGuard no_grad;
  const int64_t layers = keys.size(0), T = x.size(0), H = num_heads, KV = num_kv_heads, D = head_dim;
  const bool qk_norm = !qk_norms.empty(), int8_cache = key_scales.numel() > 0;
  // Our kernels' threads spin through the step only where every parallel loop of it is ours: torch's
  // own (dense linears, its attention) wake OpenMP threads, which would queue behind the spinners.
  const bool all_ours = our_attention && std::all_of(kinds.begin(), kinds.end(), [](int64_t kind) {
    return kind == kInt8Dot || kind == kInt4Dot;
  });
  std::optional<step_pool::AwakeScope> awake;
  if (all_ours) awake.emplace();
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
    if (int8_cache) {
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
    auto gate_up = linear(2)(rms_norm(x, norms[2 * layer + 1], eps)).split(intermediate, -1);
    x = x + linear(3)(at::silu(gate_up[0]) * gate_up[1]);
    if (next_capture < capture.size() && capture[next_capture] == layer) {
      captured.push_back(x.clone());
      ++next_capture;
    }
  }
  captured.insert(captured.begin(), x);
  return captured;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.def("rms_norm", &rms_norm, "model.RMSNorm, row by row (bf16 or fp32)", arg("x"), arg("weight"), arg("eps"));
  m.def("vnni_available", &vnni_available, "whether this CPU has AVX512-VNNI for quantized_linear.cpp's kernels");
  m.def("int8dot_available", &int8dot_available, "whether this CPU can run quantized_linear.cpp's kernels (AVX2)");
  m.def("int8dot_isa", &int8dot_isa, "which instructions they use for a call with `rows` rows", arg("rows"));
  m.def("amx_available", &amx_available, "whether they use AMX tiles for 5 rows or more here");
  m.def("int4_matmul", &int4_matmul, "x [M, K] bf16 . int4 weights (quant.py's layout) -> [M, N] bf16",
        arg("x"), arg("codes"), arg("scales"));
  m.def("int8_matmul", &int8_matmul, "x [M, K] bf16 . int8 weights (quant.py's layout) -> [M, N] bf16",
        arg("x"), arg("codes"), arg("scales"));
  m.def("step_pool_loops", &step_pool::loops_run, "parallel loops run by step_pool.cpp's spinning workers so far");
  m.def("causal_attention_available", &causal_attention_available, "whether this CPU runs causal_attention (AVX2 + FMA)");
  m.def("causal_attention_isa", &causal_attention_isa,
        "what a bf16 cache is attended with: avx512-bf16 (bf16 dot products) or avx2 (DFLASH_ATTENTION_ISA=avx2 forces it)");
  m.def("causal_attention_revision", &causal_attention_revision,
        "the revision of the sequence of operations over a bf16 cache (bumped when its bits change)");
  m.def("causal_attention", &causal_attention,
        "q [T, H, D] at positions start.. over keys/values [KV, L, D] -> [T, H, D], row-invariant (causal_attention.cpp)",
        arg("q"), arg("keys"), arg("values"), arg("start"));
  m.def("int8_kv_available", &int8_kv_available, "whether this CPU attends over an int8 cache (AVX512-VNNI)");
  m.def("int8_kv_revision", &int8_kv_revision, "the revision of the sequence of operations over an int8 cache");
  m.def("quantize_kv", &quantize_kv, "k, v [T, KV, D] -> rows start.. of an int8 layer: codes and scales (causal_attention.cpp)",
        arg("k"), arg("v"), arg("keys"), arg("values"), arg("key_scales"), arg("value_scales"), arg("start"));
  m.def("causal_attention_int8", &causal_attention_int8,
        "causal_attention over an int8 layer (keys uint8 code + 128, values int8, scales [KV, L]) -> [T, H, D] in q's dtype",
        arg("q"), arg("keys"), arg("values"), arg("key_scales"), arg("value_scales"), arg("start"));
  m.def("decode_layers", &decode_layers, "decoder layers over a few rows (see model.py)", arg("x"), arg("cos"),
        arg("sin"), arg("keys"), arg("values"), arg("key_scales"), arg("value_scales"), arg("start"), arg("norms"), arg("qk_norms"), arg("linear_tensors"),
        arg("kinds"), arg("has_bias"), arg("out_features"), arg("group_size"), arg("group_starts"),
        arg("group_ends"), arg("group_keys"), arg("group_masks"), arg("our_attention"), arg("num_heads"), arg("num_kv_heads"),
        arg("head_dim"), arg("intermediate"), arg("eps"), arg("capture"));
}
