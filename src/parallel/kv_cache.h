// KvCache: the keys and values one rank keeps for generation. Per layer, K and V
// [B, kv_heads, capacity, d] (MemCategory::kKvCache, so a test can read its bytes off the
// tracked allocator), head-major so that the keys of one head of one sequence are contiguous
// and attention reads them in place; a slot holds one token of one sequence, the same slot
// in every layer and head, with the token's global position. Under TSP a rank's slots are
// ITS tokens with every KV head (sharded by sequence); under TP they are every token with the
// rank's KV heads (sharded by heads). Slots of a sequence fill in order; their positions need
// not be contiguous or sorted, because attention reads them through the position array.
// No communication here; which rank keeps which token is the strategy's decision. Every
// write to the cache's tensors goes through the Backend passed in.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "tensor/tensor.h"

namespace foldpar {

class KvCache {
 public:
  KvCache() = default;
  // Uninitialized slots (never read before they are written). capacity: slots per sequence.
  // The cache holds the global layers [first_layer, first_layer + layers) (a pipeline stage's,
  // parallel/pipeline/; every method takes global layer indices).
  static KvCache allocate(int64_t layers, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim,
                          int64_t first_layer = 0);

  int64_t layers() const { return static_cast<int64_t>(k_.size()); }
  int64_t batch() const { return batch_; }
  int64_t capacity() const { return capacity_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t length(int64_t b) const { return length_[static_cast<size_t>(b)]; }  // filled slots of sequence b
  // The sliding window of the model's attention (LlamaConfig::sliding_window; 0: none):
  // attend_cached lets a token see only the slots whose positions lie inside it. Every slot
  // is still kept (no rolling buffer): the capacity is the full sequence's.
  int64_t window() const { return window_; }
  void set_window(int64_t window) { window_ = window; }
  // Bytes of K and V storage: 2 * L * B * capacity * kv_heads * d * 4.
  int64_t bytes() const;

  // Prefill. A prefill batch has `row_positions.size()` rows per sequence at these global
  // positions (the same for every sequence); sequence b keeps, in row order, the rows at
  // positions below prompt_lengths[b] (the rest are padding) as its first slots. Resets
  // every sequence. FP_CHECK: the kept rows fit the capacity.
  void keep_prefill_rows(Backend& be, std::span<const int32_t> row_positions, std::span<const int64_t> prompt_lengths);
  // k, v: [B, rows, n, d] (k after RoPE), heads [kv_head0, kv_head0 + n) of the prefill rows;
  // the kept rows are copied into their slots of `layer`.
  void store_prefill(Backend& be, int layer, int64_t kv_head0, const Tensor& k, const Tensor& v);

  // Decode. Reserves the next slot of sequence b for a token at `position` (every layer);
  // returns the slot. FP_CHECK: capacity.
  int64_t append(Backend& be, int64_t b, int32_t position);
  // k, v: n*d values each (any shape), heads [kv_head0, kv_head0 + n) of one token, copied
  // into `slot` of sequence b in `layer`.
  void store_token(Backend& be, int layer, int64_t b, int64_t slot, int64_t kv_head0, const Tensor& k,
                   const Tensor& v);

  // Views of sequence b's filled slots: K, V of one head [1, length(b), 1, d] (the layout
  // Backend::attention_forward takes) and the i32 positions [length(b)]. length(b) must be
  // positive.
  Tensor keys(int layer, int64_t b, int64_t kv_head) const;
  Tensor values(int layer, int64_t b, int64_t kv_head) const;
  Tensor positions(int64_t b) const;

  // Sequences [b0, b1) as a cache of b1 - b0 sequences over the same K/V and position storage
  // (a decode group, parallel/pipeline/pipeline_decoder.h): store_token into the view writes
  // this cache. The view's lengths are a copy taken now, so append on this cache first.
  KvCache sequences(int64_t b0, int64_t b1) const;

 private:
  size_t layer_slot(int layer) const;  // FP_CHECK: a layer this cache holds

  // Heads [kv_head0, kv_head0 + n) of `rows` tokens into slots [slot, slot + rows) of
  // sequence b: token i's head j at src_offset + i * src_row_stride + j * d of src.
  void copy_heads(Backend& be, const Tensor& src, int64_t src_offset, int64_t src_row_stride, int64_t rows,
                  Tensor& dst_layer, int64_t b, int64_t slot, int64_t kv_head0, int64_t n);

  int64_t batch_ = 0, capacity_ = 0, kv_heads_ = 0, head_dim_ = 0, window_ = 0, first_layer_ = 0;
  std::vector<Tensor> k_, v_;    // L x [B, kv_heads, capacity, d]
  Tensor positions_;             // i32 [B, capacity]
  std::vector<int64_t> length_;  // [B]
  // Prefill row -> slot (or -1) of each sequence, set by keep_prefill_rows.
  std::vector<std::vector<int64_t>> prefill_slot_;
};

}  // namespace foldpar
