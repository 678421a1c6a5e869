// KV cache slots: prefill rows kept (padding dropped), decode tokens appended, views for attention.
#include "parallel/kv_cache.h"

#include <algorithm>

#include "core/check.h"

namespace foldpar {

KvCache KvCache::allocate(int64_t layers, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim,
                          int64_t first_layer) {
  FP_CHECK(layers > 0 && batch > 0 && capacity > 0 && kv_heads > 0 && head_dim > 0 && first_layer >= 0,
           "KV cache of {} layers from {}, {} sequences, {} slots, {} heads of {}", layers, first_layer, batch, capacity,
           kv_heads, head_dim);
  KvCache c;
  c.first_layer_ = first_layer;
  c.batch_ = batch;
  c.capacity_ = capacity;
  c.kv_heads_ = kv_heads;
  c.head_dim_ = head_dim;
  for (int64_t l = 0; l < layers; ++l) {
    c.k_.push_back(Tensor::empty({batch, kv_heads, capacity, head_dim}, DType::kF32, MemCategory::kKvCache));
    c.v_.push_back(Tensor::empty({batch, kv_heads, capacity, head_dim}, DType::kF32, MemCategory::kKvCache));
  }
  // Metadata, not part of the K/V bytes the cache formula counts.
  // Written by keep_prefill_rows (every slot of every sequence) before any read.
  c.positions_ = Tensor::empty({batch, capacity}, DType::kI32, MemCategory::kActivations);
  c.length_.assign(static_cast<size_t>(batch), 0);
  c.prefill_slot_.assign(static_cast<size_t>(batch), {});
  return c;
}

size_t KvCache::layer_slot(int layer) const {
  FP_CHECK(layer >= first_layer_ && layer < first_layer_ + layers(), "layer {} of a KV cache of layers [{}, {})", layer,
           first_layer_, first_layer_ + layers());
  return static_cast<size_t>(layer - first_layer_);
}

KvCache KvCache::sequences(int64_t b0, int64_t b1) const {
  FP_CHECK(0 <= b0 && b0 < b1 && b1 <= batch_, "sequences [{}, {}) of a KV cache of {}", b0, b1, batch_);
  KvCache c = *this;
  c.batch_ = b1 - b0;
  for (size_t l = 0; l < k_.size(); ++l) {
    c.k_[l] = k_[l].narrow(b0, b1);
    c.v_[l] = v_[l].narrow(b0, b1);
  }
  c.positions_ = positions_.narrow(b0, b1);
  c.length_.assign(length_.begin() + b0, length_.begin() + b1);
  c.prefill_slot_.assign(prefill_slot_.begin() + b0, prefill_slot_.begin() + b1);
  return c;
}

int64_t KvCache::bytes() const { return 2 * layers() * batch_ * capacity_ * kv_heads_ * head_dim_ * 4; }

void KvCache::keep_prefill_rows(Backend& be, std::span<const int32_t> row_positions,
                                std::span<const int64_t> prompt_lengths) {
  FP_CHECK(static_cast<int64_t>(prompt_lengths.size()) == batch_, "{} prompt lengths for a cache of {} sequences",
           prompt_lengths.size(), batch_);
  std::vector<int32_t> pos(static_cast<size_t>(batch_ * capacity_), 0);
  for (int64_t b = 0; b < batch_; ++b) {
    std::vector<int64_t>& slots = prefill_slot_[static_cast<size_t>(b)];
    slots.assign(row_positions.size(), -1);
    int64_t n = 0;
    for (size_t i = 0; i < row_positions.size(); ++i) {
      if (row_positions[i] >= prompt_lengths[static_cast<size_t>(b)]) continue;
      FP_CHECK(n < capacity_, "sequence {} keeps more prefill rows than the cache's {} slots", b, capacity_);
      pos[static_cast<size_t>(b * capacity_ + n)] = row_positions[i];
      slots[i] = n++;
    }
    length_[static_cast<size_t>(b)] = n;
  }
  be.copy_from_host(std::as_bytes(std::span<const int32_t>(pos)), positions_);
}

void KvCache::copy_heads(Backend& be, const Tensor& src, int64_t src_offset, int64_t src_row_stride, int64_t rows,
                         Tensor& dst_layer, int64_t b, int64_t slot, int64_t kv_head0, int64_t n) {
  FP_CHECK(kv_head0 >= 0 && kv_head0 + n <= kv_heads_, "heads [{}, {}) of a cache with {}", kv_head0, kv_head0 + n,
           kv_heads_);
  FP_CHECK(slot >= 0 && slot + rows <= capacity_, "slots [{}, {}) of a cache with {}", slot, slot + rows, capacity_);
  for (int64_t j = 0; j < n; ++j)
    be.copy_strided(src, dst_layer,
                    {rows, head_dim_, {src_offset + j * head_dim_, src_row_stride},
                     {((b * kv_heads_ + kv_head0 + j) * capacity_ + slot) * head_dim_, head_dim_}});
}

void KvCache::store_prefill(Backend& be, int layer, int64_t kv_head0, const Tensor& k, const Tensor& v) {
  FP_CHECK(k.rank() == 4 && k.shape() == v.shape() && k.dim(0) == batch_ && k.dim(3) == head_dim_ &&
               k.dtype() == DType::kF32 && v.dtype() == DType::kF32,
           "prefill K {} / V {} for a cache of {} sequences, head dim {}", k.describe(), v.describe(), batch_, head_dim_);
  const int64_t rows = k.dim(1), n = k.dim(2);
  Tensor& kl = k_[layer_slot(layer)];
  Tensor& vl = v_[layer_slot(layer)];
  for (int64_t b = 0; b < batch_; ++b) {
    const std::vector<int64_t>& slots = prefill_slot_[static_cast<size_t>(b)];
    FP_CHECK(static_cast<int64_t>(slots.size()) == rows, "prefill of {} rows, {} expected", rows, slots.size());
    // Runs of kept rows whose slots are consecutive move as one block per head.
    for (int64_t i = 0; i < rows;) {
      const int64_t slot = slots[static_cast<size_t>(i)];
      if (slot < 0) {
        ++i;
        continue;
      }
      int64_t run = 1;
      while (i + run < rows && slots[static_cast<size_t>(i + run)] == slot + run) ++run;
      const int64_t src = ((b * rows + i) * n) * head_dim_;
      copy_heads(be, k, src, n * head_dim_, run, kl, b, slot, kv_head0, n);
      copy_heads(be, v, src, n * head_dim_, run, vl, b, slot, kv_head0, n);
      i += run;
    }
  }
}

int64_t KvCache::append(Backend& be, int64_t b, int32_t position) {
  int64_t& len = length_[static_cast<size_t>(b)];
  FP_CHECK(len < capacity_, "KV cache of sequence {} is full ({} slots)", b, capacity_);
  Tensor slot = positions_.reshape({batch_ * capacity_}).narrow(b * capacity_ + len, b * capacity_ + len + 1);
  be.copy_from_host(std::as_bytes(std::span<const int32_t>(&position, 1)), slot);
  return len++;
}

void KvCache::store_token(Backend& be, int layer, int64_t b, int64_t slot, int64_t kv_head0, const Tensor& k,
                          const Tensor& v) {
  FP_CHECK(k.numel() == v.numel() && k.numel() % head_dim_ == 0 && slot >= 0 && slot < length(b) &&
               k.dtype() == DType::kF32 && v.dtype() == DType::kF32,
           "token K {} / V {} into slot {} of sequence {} ({} filled)", k.describe(), v.describe(), slot, b, length(b));
  const int64_t n = k.numel() / head_dim_;
  copy_heads(be, k, 0, 0, 1, k_[layer_slot(layer)], b, slot, kv_head0, n);
  copy_heads(be, v, 0, 0, 1, v_[layer_slot(layer)], b, slot, kv_head0, n);
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
  return head_view(k_[layer_slot(layer)], b, kv_head, length(b));
}

Tensor KvCache::values(int layer, int64_t b, int64_t kv_head) const {
  FP_CHECK(length(b) > 0, "values of sequence {}: nothing cached", b);
  return head_view(v_[layer_slot(layer)], b, kv_head, length(b));
}

Tensor KvCache::positions(int64_t b) const {
  FP_CHECK(length(b) > 0, "positions of sequence {}: nothing cached", b);
  return positions_.narrow(b, b + 1).reshape({capacity_}).narrow(0, length(b));
}

}  // namespace foldpar
