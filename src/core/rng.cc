// Counter-based uniform and normal samples.
#include "core/rng.h"

#include <cmath>
#include <numbers>

namespace foldpar {

double uniform_at(uint64_t seed, uint64_t stream, uint64_t index) {
  return static_cast<double>(hash_u64(seed, stream, index) >> 11) * 0x1.0p-53;
}

double normal_at(uint64_t seed, uint64_t stream, uint64_t index) {
  // Two independent uniforms from the two halves of a 2*index counter pair; u1 in (0, 1].
  const double u1 = 1.0 - uniform_at(seed, stream, 2 * index);
  const double u2 = uniform_at(seed, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace foldpar
