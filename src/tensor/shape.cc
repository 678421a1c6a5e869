// Shape helpers.
#include "tensor/shape.h"

#include <fmt/format.h>

#include "core/check.h"

namespace foldpar {

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) push_back(d);
}

void Shape::push_back(int64_t d) {
  FP_CHECK(rank_ < kMaxRank, "rank above {}", kMaxRank);
  FP_CHECK(d >= 0, "negative extent {}", d);
  dims_[rank_++] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

int64_t Shape::stride(int i) const {
  int64_t s = 1;
  for (int j = rank_ - 1; j > i; --j) s *= dims_[j];
  return s;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::to_string() const {
  return fmt::format("[{}]", fmt::join(begin(), end(), ", "));
}

}  // namespace foldpar
