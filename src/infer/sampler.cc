// Greedy choice and temperature / top-k / top-p sampling in f64.
#include "infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/rng.h"

namespace foldpar {

Status SamplingOptions::validate() const {
  if (!(temperature >= 0) || !std::isfinite(temperature))
    return invalid_argument("--temperature ({}) must be 0 (greedy) or positive", temperature);
  if (top_k < 0) return invalid_argument("--top-k ({}) must be 0 (off) or positive", top_k);
  if (!(top_p > 0 && top_p <= 1)) return invalid_argument("--top-p ({}) must be in (0, 1]", top_p);
  return Status();
}

namespace {

int32_t argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

constexpr uint64_t kSamplingStream = stream_id("foldpar.sample");

}  // namespace

int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, uint64_t sequence, uint64_t step) {
  if (o.temperature == 0 || o.top_k == 1) return argmax(logits);
  const size_t V = logits.size();
  // Candidates from the most likely down (ties: lower id first), cut to top_k.
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  const size_t k = o.top_k > 0 ? std::min(V, static_cast<size_t>(o.top_k)) : V;
  auto more_likely = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), more_likely);
  order.resize(k);
  // Probabilities under the temperature, renormalized over the candidates.
  const double top = logits[order[0]];
  std::vector<double> p(k);
  double total = 0;
  for (size_t i = 0; i < k; ++i) total += p[i] = std::exp((logits[order[i]] - top) / o.temperature);
  // Nucleus: the shortest prefix whose mass reaches top_p (at least one token).
  size_t keep = k;
  if (o.top_p < 1) {
    double mass = 0;
    for (size_t i = 0; i < k; ++i) {
      mass += p[i] / total;
      if (mass >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  const double kept = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  double u = uniform_at(o.seed, kSamplingStream + sequence, step) * kept;
  for (size_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u < 0) return order[i];
  }
  return order[keep - 1];  // u landed on the rounding at the end
}

}  // namespace foldpar
