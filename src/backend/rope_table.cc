// RoPE table construction: the inverse frequencies of each rope_scaling type (the formulas of
// Hugging Face transformers' modeling_rope_utils, in double), then the table on the host,
// copied into the backend's memory.
#include "backend/rope_table.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace foldpar {

namespace {

// theta^(-2i/d), i < d/2: the unscaled frequencies.
std::vector<double> default_inv_freq(int64_t d, double theta) {
  std::vector<double> f(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) f[static_cast<size_t>(i)] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / d);
  return f;
}

// llama3: long wavelengths (> original / low_freq_factor) divided by factor, short ones
// (< original / high_freq_factor) kept, those between interpolated by a smooth factor.
void apply_llama3(const RopeScaling& s, std::vector<double>& f) {
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_wavelen = old_len / s.low_freq_factor, high_wavelen = old_len / s.high_freq_factor;
  for (double& inv : f) {
    const double wavelen = 2 * std::numbers::pi / inv;
    if (wavelen > low_wavelen) {
      inv /= s.factor;
    } else if (!(wavelen < high_wavelen)) {
      const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      inv = (1 - smooth) * inv / s.factor + smooth * inv;
    }
  }
}

double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// yarn: per dimension pair, a linear ramp between extrapolated (theta^(-2i/d)) and
// interpolated (/ factor) frequencies over the correction range of beta_fast..beta_slow
// rotations within the original context; attention factor 0.1 ln(factor) + 1 by default.
double apply_yarn(const RopeSpec& spec, std::vector<double>& f) {
  const RopeScaling& s = spec.scaling;
  const double d = static_cast<double>(spec.head_dim);
  const double original = static_cast<double>(
      s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings : spec.max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return d * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(spec.theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, d - 1);
  if (low == high) high += 0.001;  // Hugging Face's guard against a zero-width ramp
  for (size_t i = 0; i < f.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1 - ramp;  // weight of the unscaled frequency
    f[i] = f[i] / s.factor * (1 - extrapolation) + f[i] * extrapolation;
  }
  if (s.attention_factor > 0) return s.attention_factor;
  if (s.mscale != 0 && s.mscale_all_dim != 0)
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

template <typename T>
void fill_and_upload(Backend& be, std::span<const int32_t> positions, const RopeFrequencies& rf, Tensor& table) {
  const int64_t half = static_cast<int64_t>(rf.inv_freq.size()), n = static_cast<int64_t>(positions.size());
  std::vector<T> t(static_cast<size_t>(n * 2 * half));
  // A table without storage (the plan's dry run) is never read: the upload is recorded with
  // its bytes, and the angles (most of a 128K-token plan's time) are skipped.
  if (table.has_storage())
    for (int64_t p = 0; p < n; ++p)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(positions[p]) * rf.inv_freq[static_cast<size_t>(i)];
        t[static_cast<size_t>((p * 2 + 0) * half + i)] = static_cast<T>(std::cos(angle) * rf.attention_factor);
        t[static_cast<size_t>((p * 2 + 1) * half + i)] = static_cast<T>(std::sin(angle) * rf.attention_factor);
      }
  be.copy_from_host(std::as_bytes(std::span<const T>(t)), table);
}

}  // namespace

const char* rope_type_name(RopeScaling::Type type) {
  switch (type) {
    case RopeScaling::Type::kDefault: return "default";
    case RopeScaling::Type::kLinear: return "linear";
    case RopeScaling::Type::kDynamic: return "dynamic";
    case RopeScaling::Type::kLlama3: return "llama3";
    case RopeScaling::Type::kYarn: return "yarn";
  }
  return "?";
}

RopeFrequencies rope_frequencies(const RopeSpec& spec, int64_t seq_len) {
  FP_CHECK(spec.head_dim >= 2 && spec.head_dim % 2 == 0, "head dim {} must be even for RoPE", spec.head_dim);
  const RopeScaling& s = spec.scaling;
  RopeFrequencies rf;
  switch (s.type) {
    case RopeScaling::Type::kDefault:
      rf.inv_freq = default_inv_freq(spec.head_dim, spec.theta);
      break;
    case RopeScaling::Type::kLinear:
      rf.inv_freq = default_inv_freq(spec.head_dim, spec.theta);
      for (double& f : rf.inv_freq) f /= s.factor;
      break;
    case RopeScaling::Type::kDynamic: {
      // NTK-aware: theta * ((factor * L / max_pos) - (factor - 1))^(d / (d - 2)), L = max(seq_len, max_pos).
      const double max_pos = static_cast<double>(spec.max_position_embeddings);
      const double L = std::max(static_cast<double>(seq_len), max_pos), d = static_cast<double>(spec.head_dim);
      const double base = spec.theta * std::pow(s.factor * L / max_pos - (s.factor - 1), d / (d - 2));
      rf.inv_freq = default_inv_freq(spec.head_dim, base);
      break;
    }
    case RopeScaling::Type::kLlama3:
      rf.inv_freq = default_inv_freq(spec.head_dim, spec.theta);
      apply_llama3(s, rf.inv_freq);
      break;
    case RopeScaling::Type::kYarn:
      rf.inv_freq = default_inv_freq(spec.head_dim, spec.theta);
      rf.attention_factor = apply_yarn(spec, rf.inv_freq);
      break;
  }
  return rf;
}

Tensor build_rope_table(Backend& be, std::span<const int32_t> positions, const RopeSpec& spec, int64_t seq_len,
                        DType dtype, MemCategory category) {
  FP_CHECK(dtype == DType::kF32 || dtype == DType::kF64, "rope table dtype {}", dtype_name(dtype));
  const RopeFrequencies rf = rope_frequencies(spec, seq_len);
  Tensor table = Tensor::empty({static_cast<int64_t>(positions.size()), 2, spec.head_dim / 2}, dtype, category);
  if (dtype == DType::kF32) {
    fill_and_upload<float>(be, positions, rf, table);
  } else {
    fill_and_upload<double>(be, positions, rf, table);
  }
  return table;
}

Tensor build_rope_table(Backend& be, std::span<const int32_t> positions, int64_t head_dim, double theta, DType dtype,
                        MemCategory category) {
  RopeSpec spec;
  spec.head_dim = head_dim;
  spec.theta = theta;
  return build_rope_table(be, positions, spec, 0, dtype, category);
}

}  // namespace foldpar
