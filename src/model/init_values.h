// init_value's loop form: one tensor's random stream (a hash of its name) and kind (norm gain
// or weight) looked up once, then any element. Equal to init_value(options, name, index) bit
// for bit; the name's hash per element was about a third of initialization's time.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "core/rng.h"
#include "model/llama_weights.h"

namespace foldpar {

class InitValues {
 public:
  InitValues(const InitOptions& o, const std::string& name)
      : seed_(o.seed),
        stream_(stream_id(name)),
        norm_(name.ends_with("norm.weight")),
        scale_(norm_ ? o.norm_jitter : o.std) {}

  // Element `index` of the tensor: 1 + norm_jitter z for a norm gain (one rounding: an
  // explicit fma, so that every translation unit that inlines this gives the same bits
  // whatever its compiler contracts), std z otherwise.
  double at(int64_t index) const {
    const double z = normal_at(seed_, stream_, static_cast<uint64_t>(index));
    return norm_ ? std::fma(scale_, z, 1.0) : scale_ * z;
  }

 private:
  uint64_t seed_, stream_;
  bool norm_;
  double scale_;
};

}  // namespace foldpar
