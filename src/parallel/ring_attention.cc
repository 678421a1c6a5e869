// Ring attention: the K/V ring, the online-softmax merge and the adjoint ring.
//
// Forward, step j = 0..N-1, this rank holding the K/V block of rank (p - j) mod N:
//   start hop (send the block to p+1, receive the next from p-1)   fwd: K/V ring
//   out_j, lse_j = attention(q, block)        (block positions; lse -inf where nothing is visible)
//   out, lse = merge(out, lse, out_j, lse_j)  (the online softmax)
// Backward, the same ring again; at step j the attention backward of the visiting block
// against the FINAL out and lse gives dq_j (summed locally) and the block's dK/dV partial,
// which joins the accumulator that travels behind the blocks (bwd of the K/V ring): the
// accumulator of block r starts at r+1, picks up each rank's partial and after N-1 hops
// reaches r, which adds its own (step 0) partial. Blocks that no local query can see are
// skipped (contiguous split: the blocks of later ranks), their partial is zero.
// Storage: the blocks and the dK/dV accumulator travel in q/k/v's dtype (f32, or bf16 under
// bf16 storage: 2 bytes an element), out and each block's result are in that dtype too (a
// backend that stores bf16 computes attention into bf16 and merges like with like), lse
// is f32 throughout: with bf16, out is rounded once per merge.
#include "parallel/ring_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace foldpar {
namespace {

// The ring of one call: shapes, hops, waits, which blocks are visible.
class Ring {
 public:
  explicit Ring(const RingAttentionArgs& a) : a_(a), be_(*a.backend), comm_(*a.axis) {
    const Tensor &q = *a.q, &k = *a.k, &v = *a.v;
    FP_CHECK(q.rank() == 4 && k.rank() == 4 && v.shape() == k.shape() && q.dim(0) == k.dim(0) &&
                 q.dim(3) == k.dim(3) && (q.dtype() == DType::kF32 || q.dtype() == DType::kBF16) &&
                 k.dtype() == q.dtype() && v.dtype() == q.dtype(),
             "ring attention of q {}, k {}, v {}", q.describe(), k.describe(), v.describe());
    N_ = comm_.size();
    p_ = comm_.rank();
    sk_ = k.dim(1);
    FP_CHECK(a.q_pos->numel() == q.dim(1) && a.k_pos->numel() == N_ * sk_ && a.q_pos->dtype() == DType::kI32 &&
                 a.k_pos->dtype() == DType::kI32 && std::ssize(a.q_positions) == q.dim(1) &&
                 std::ssize(a.k_positions) == N_ * sk_,
             "ring attention positions q_pos {} ({} on the host), k_pos {} ({}) for q {} and {} blocks of {} keys",
             a.q_pos->describe(), a.q_positions.size(), a.k_pos->describe(), a.k_positions.size(), q.describe(), N_,
             sk_);
    const std::span<const int32_t> qp = a.q_positions;
    q_max_ = qp.empty() ? std::numeric_limits<int32_t>::min() : *std::max_element(qp.begin(), qp.end());
    kv_shape_ = k.shape();
    dtype_ = k.dtype();
  }
  DType dtype() const { return dtype_; }

  int size() const { return N_; }
  // At step j this rank holds the block of rank (p - j) mod N.
  int owner(int step) const { return ((p_ - step) % N_ + N_) % N_; }
  // Key positions of rank r's block: i32 [Sk].
  Tensor block_pos(int r) const { return a_.k_pos->narrow(r * sk_, (r + 1) * sk_); }
  // Whether any key of rank r's block is visible to some local query.
  bool visible(int r) const {
    const std::span<const int32_t> kp = a_.k_positions.subspan(static_cast<size_t>(r * sk_), static_cast<size_t>(sk_));
    return sk_ > 0 && *std::min_element(kp.begin(), kp.end()) <= q_max_;
  }

  // K then V in one buffer [2, B, Sk, n_kv, d], so a block moves in one message.
  Tensor packed_buffer() const {
    Shape s({2, kv_shape_[0], kv_shape_[1], kv_shape_[2], kv_shape_[3]});
    return Tensor::empty(s, dtype_, MemCategory::kComm);
  }
  Tensor half(const Tensor& packed, int i) const { return packed.narrow(i, i + 1).reshape(kv_shape_); }
  Tensor pack_own() const {
    Tensor packed = packed_buffer();
    Tensor k = half(packed, 0), v = half(packed, 1);
    be_.copy(*a_.k, k);
    be_.copy(*a_.v, v);
    return packed;
  }

  // One forward hop: send `send` to p+1 while `recv` arrives from p-1.
  CommRequest start_hop(const Tensor& send, Tensor& recv) {
    CommRequest hop = comm_.isend_recv(send.raw_data(), recv.raw_data(), static_cast<size_t>(send.numel()),
                                       send.dtype(), (p_ + 1) % N_, (p_ - 1 + N_) % N_);
    if (!a_.overlap) wait(hop);
    return hop;
  }
  void wait(CommRequest& request) {
    if (a_.timer != nullptr) {
      a_.timer->wait(request);
    } else if (request.pending()) {
      FP_CHECK_OK(request.wait());
    }
  }
  // MPI moves a transfer only inside MPI calls: advance it between pieces of computation.
  static void poke(CommRequest& request) { StepTimer::poke(request); }

  AttentionArgs attention_args(const Tensor& block, int r, Tensor& k, Tensor& v, Tensor& pos) const {
    k = half(block, 0);
    v = half(block, 1);
    pos = block_pos(r);
    return AttentionArgs{a_.q, &k, &v, a_.q_pos, &pos, a_.scale, a_.window};
  }

 private:
  const RingAttentionArgs& a_;
  Backend& be_;
  Communicator& comm_;
  int N_ = 1, p_ = 0;
  int64_t sk_ = 0;
  int32_t q_max_ = 0;
  Shape kv_shape_;
  DType dtype_ = DType::kF32;
};

}  // namespace

void merge_attention_block(Backend& be, const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) {
  FP_CHECK((out.dtype() == DType::kF32 || out.dtype() == DType::kBF16) && lse.dtype() == DType::kF32,
           "merge of block {} / {} into {} / {}",
           block_out.describe(), block_lse.describe(), out.describe(), lse.describe());
  be.attention_merge(block_out, block_lse, out, lse);
}

void ring_attention_forward(const RingAttentionArgs& a, Tensor& out, Tensor& lse) {
  Backend& be = *a.backend;
  Ring ring(a);
  const int N = ring.size();
  FP_CHECK(lse.dtype() == DType::kF32 && out.dtype() == ring.dtype(), "ring attention of {} into out {}, lse {}",
           dtype_name(ring.dtype()), out.describe(), lse.describe());
  Tensor cur = ring.pack_own();
  for (int j = 0; j < N; ++j) {
    Tensor next;
    CommRequest hop;
    if (j + 1 < N) {
      next = ring.packed_buffer();
      hop = ring.start_hop(cur, next);
    }
    const int r = ring.owner(j);
    Tensor k, v, pos;
    if (j == 0 && !ring.visible(r)) {
      be.fill(0.0, out);
      be.fill(-INFINITY, lse);
    } else if (j == 0) {
      be.attention_forward(ring.attention_args(cur, r, k, v, pos), out, lse);
      Ring::poke(hop);
    } else if (ring.visible(r)) {
      Tensor block_out = Tensor::empty(out.shape(), out.dtype(), MemCategory::kWorkspace);
      Tensor block_lse = Tensor::empty(lse.shape(), DType::kF32, MemCategory::kWorkspace);
      be.attention_forward(ring.attention_args(cur, r, k, v, pos), block_out, block_lse);
      Ring::poke(hop);
      merge_attention_block(be, block_out, block_lse, out, lse);
    }
    if (j + 1 < N) {
      ring.wait(hop);
      cur = std::move(next);
    }
  }
}

void ring_attention_backward(const RingAttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                             Tensor& dq, Tensor& dk, Tensor& dv) {
  Backend& be = *a.backend;
  Ring ring(a);
  const int N = ring.size();
  Tensor cur = ring.pack_own();
  Tensor own;                // dK|dV of this rank's block: the step-0 partial, then the sum
  Tensor incoming, sending;  // the accumulator ring
  CommRequest grad_hop;
  for (int j = 0; j < N; ++j) {
    Tensor next;
    CommRequest hop;
    if (j + 1 < N) {
      next = ring.packed_buffer();
      hop = ring.start_hop(cur, next);
    }
    const int r = ring.owner(j);
    // dK|dV of block r from the local queries.
    Tensor partial = ring.packed_buffer();
    if (ring.visible(r)) {
      Tensor k, v, pos;
      Tensor dq_j = j == 0 ? dq : Tensor::empty(dq.shape(), dq.dtype(), MemCategory::kWorkspace);
      Tensor dk_j = ring.half(partial, 0), dv_j = ring.half(partial, 1);
      be.attention_backward(ring.attention_args(cur, r, k, v, pos), out, lse, d_out, dq_j, dk_j, dv_j);
      if (j > 0) be.add_inplace(dq_j, dq);
    } else {
      if (j == 0) be.fill(0.0, dq);
      be.fill(0.0, partial);
    }
    Ring::poke(hop);
    Ring::poke(grad_hop);
    // The accumulator ring (bwd of the K/V ring): add what arrived, pass it on.
    if (j == 0) {
      own = partial;
    } else {
      if (j >= 2) {
        ring.wait(grad_hop);
        be.add_inplace(incoming, partial);
      }
      sending = partial;
      incoming = ring.packed_buffer();
      grad_hop = ring.start_hop(sending, incoming);
    }
    if (j + 1 < N) {
      ring.wait(hop);
      cur = std::move(next);
    }
  }
  if (N > 1) {  // the accumulator of this rank's own block comes home
    ring.wait(grad_hop);
    be.add_inplace(incoming, own);
  }
  be.copy(ring.half(own, 0), dk);
  be.copy(ring.half(own, 1), dv);
}

}  // namespace foldpar
