// Deterministic random numbers. Two kinds:
//  - counter-based: value = f(seed, stream, index). Any rank can generate any element of a
//    global tensor without generating the others, so a shard initialized on its owner equals
//    the same slice of the single-rank model's tensor, bit for bit.
//  - Rng: a small sequential generator (splitmix64) whose whole state is one integer, so a
//    checkpoint can save and restore it.
#pragma once

#include <cstdint>
#include <string_view>

namespace foldpar {

// splitmix64's finalizer: a bijective 64-bit mix with good avalanche.
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A stream id from a name (FNV-1a), e.g. the parameter's Hugging Face name.
constexpr uint64_t stream_id(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

constexpr uint64_t hash_u64(uint64_t seed, uint64_t stream, uint64_t index) {
  return mix64(mix64(seed ^ mix64(stream + 0x9e3779b97f4a7c15ULL)) + index);
}

// Uniform in [0, 1) with 53 random bits.
double uniform_at(uint64_t seed, uint64_t stream, uint64_t index);
// Standard normal (Box-Muller over two counter-based uniforms).
double normal_at(uint64_t seed, uint64_t stream, uint64_t index);

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return mix64(state_);
  }
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n > 0 (rejection-free multiply-shift; bias < 2^-32 for n < 2^32).
  uint64_t below(uint64_t n) {
    __extension__ using U128 = unsigned __int128;
    return static_cast<uint64_t>((static_cast<U128>(next_u64()) * n) >> 64);
  }
  uint64_t state() const { return state_; }
  void set_state(uint64_t state) { state_ = state; }

 private:
  uint64_t state_;
};

}  // namespace foldpar
