// KV cache slots: prefill rows kept (padding dropped), decode tokens appended, views for attention.
#include "parallel/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace foldpar {

KvCache KvCache::allocate(int64_t layers, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim) {
  FP_CHECK(layers > 0 && batch > 0 && capacity > 0 && kv_heads > 0 && head_dim > 0,
           "KV cache of {} layers, {} sequences, {} slots, {} heads of {}", layers, batch, capacity, kv_heads, head_dim);
  KvCache c;
  c.batch_ = batch;
  c.capacity_ = capacity;
  c.kv_heads_ = kv_heads;
  c.head_dim_ = head_dim;
  for (int64_t l = 0; l < layers; ++l) {
    c.k_.push_back(Tensor::empty({batch, kv_heads, capacity, head_dim}, DType::kF32, MemCategory::kKvCache));
    c.v_.push_back(Tensor::empty({batch, kv_heads, capacity, head_dim}, DType::kF32, MemCategory::kKvCache));
  }
  // Metadata, not part of the K/V bytes the cache formula counts.
  c.positions_ = Tensor::zeros({batch, capacity}, DType::kI32, MemCategory::kActivations);
  c.length_.assign(static_cast<size_t>(batch), 0);
  c.prefill_slot_.assign(static_cast<size_t>(batch), {});
  return c;
}

int64_t KvCache::bytes() const { return 2 * layers() * batch_ * capacity_ * kv_heads_ * head_dim_ * 4; }

void KvCache::keep_prefill_rows(std::span<const int32_t> row_positions, std::span<const int64_t> prompt_lengths) {
  FP_CHECK(static_cast<int64_t>(prompt_lengths.size()) == batch_, "{} prompt lengths for a cache of {} sequences",
           prompt_lengths.size(), batch_);
  int32_t* pos = positions_.data<int32_t>();
  for (int64_t b = 0; b < batch_; ++b) {
    std::vector<int64_t>& slots = prefill_slot_[static_cast<size_t>(b)];
    slots.assign(row_positions.size(), -1);
    int64_t n = 0;
    for (size_t i = 0; i < row_positions.size(); ++i) {
      if (row_positions[i] >= prompt_lengths[static_cast<size_t>(b)]) continue;
      FP_CHECK(n < capacity_, "sequence {} keeps more prefill rows than the cache's {} slots", b, capacity_);
      pos[b * capacity_ + n] = row_positions[i];
      slots[i] = n++;
    }
    length_[static_cast<size_t>(b)] = n;
  }
}

void KvCache::copy_heads(Tensor& dst_layer, int64_t b, int64_t slot, int64_t kv_head0, int64_t n, const float* src) {
  FP_CHECK(kv_head0 >= 0 && kv_head0 + n <= kv_heads_, "heads [{}, {}) of a cache with {}", kv_head0, kv_head0 + n,
           kv_heads_);
  for (int64_t j = 0; j < n; ++j) {
    float* dst = dst_layer.data<float>() + ((b * kv_heads_ + kv_head0 + j) * capacity_ + slot) * head_dim_;
    std::memcpy(dst, src + j * head_dim_, static_cast<size_t>(head_dim_) * sizeof(float));
  }
}

void KvCache::store_prefill(int layer, int64_t kv_head0, const Tensor& k, const Tensor& v) {
  FP_CHECK(k.rank() == 4 && k.shape() == v.shape() && k.dim(0) == batch_ && k.dim(3) == head_dim_,
           "prefill K {} / V {} for a cache of {} sequences, head dim {}", k.describe(), v.describe(), batch_, head_dim_);
  const int64_t rows = k.dim(1), n = k.dim(2);
  Tensor& kl = k_[static_cast<size_t>(layer)];
  Tensor& vl = v_[static_cast<size_t>(layer)];
  for (int64_t b = 0; b < batch_; ++b) {
    const std::vector<int64_t>& slots = prefill_slot_[static_cast<size_t>(b)];
    FP_CHECK(static_cast<int64_t>(slots.size()) == rows, "prefill of {} rows, {} expected", rows, slots.size());
    for (int64_t i = 0; i < rows; ++i) {
      if (slots[static_cast<size_t>(i)] < 0) continue;
      const int64_t src = ((b * rows + i) * n) * head_dim_;
      copy_heads(kl, b, slots[static_cast<size_t>(i)], kv_head0, n, k.data<float>() + src);
      copy_heads(vl, b, slots[static_cast<size_t>(i)], kv_head0, n, v.data<float>() + src);
    }
  }
}

int64_t KvCache::append(int64_t b, int32_t position) {
  int64_t& len = length_[static_cast<size_t>(b)];
  FP_CHECK(len < capacity_, "KV cache of sequence {} is full ({} slots)", b, capacity_);
  positions_.data<int32_t>()[b * capacity_ + len] = position;
  return len++;
}

void KvCache::store_token(int layer, int64_t b, int64_t slot, int64_t kv_head0, const Tensor& k, const Tensor& v) {
  FP_CHECK(k.numel() == v.numel() && k.numel() % head_dim_ == 0 && slot >= 0 && slot < length(b),
           "token K {} / V {} into slot {} of sequence {} ({} filled)", k.describe(), v.describe(), slot, b, length(b));
  const int64_t n = k.numel() / head_dim_;
  copy_heads(k_[static_cast<size_t>(layer)], b, slot, kv_head0, n, k.data<float>());
  copy_heads(v_[static_cast<size_t>(layer)], b, slot, kv_head0, n, v.data<float>());
}

namespace {

// [B, kv_heads, capacity, d] -> the first `len` slots of (b, head) as [1, len, 1, d].
Tensor head_view(const Tensor& t, int64_t b, int64_t head, int64_t len) {
  const int64_t heads = t.dim(1), cap = t.dim(2), d = t.dim(3), row = b * heads + head;
  FP_CHECK(head >= 0 && head < heads, "KV head {} of {}", head, heads);
  return t.reshape({t.dim(0) * heads, cap, d}).narrow(row, row + 1).reshape({cap, d}).narrow(0, len).reshape({1, len, 1, d});
}

}  // namespace

Tensor KvCache::keys(int layer, int64_t b, int64_t kv_head) const {
  FP_CHECK(length(b) > 0, "keys of sequence {}: nothing cached", b);
  return head_view(k_[static_cast<size_t>(layer)], b, kv_head, length(b));
}

Tensor KvCache::values(int layer, int64_t b, int64_t kv_head) const {
  FP_CHECK(length(b) > 0, "values of sequence {}: nothing cached", b);
  return head_view(v_[static_cast<size_t>(layer)], b, kv_head, length(b));
}

Tensor KvCache::positions(int64_t b) const {
  FP_CHECK(length(b) > 0, "positions of sequence {}: nothing cached", b);
  return positions_.narrow(b, b + 1).reshape({capacity_}).narrow(0, length(b));
}

}  // namespace foldpar
