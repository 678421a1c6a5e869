// StageBoundary: the non-blocking point-to-point transfers between neighbouring stages.
#include "parallel/pipeline/pipeline_boundary.h"

#include <algorithm>

#include "core/check.h"

namespace foldpar {
namespace {

// {0} the peer's stage, {1} its world rank, {6} the model axis and {2} the index on it,
// {3} the micro-batch, {4} this rank's stage.
constexpr const char* kNeverSentActivation =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never sent the activation of micro-batch {3} to stage {4}";
constexpr const char* kNeverSentGradient =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never sent the gradient of micro-batch {3} to stage {4}";
constexpr const char* kNeverReceivedActivation =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never received the activation of micro-batch {3} from "
    "stage {4}";
constexpr const char* kNeverReceivedGradient =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never received the gradient of micro-batch {3} from stage {4}";
// Interleaved: {5} the global chunk the message is for.
constexpr const char* kNeverSentChunkActivation =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never sent the activation of micro-batch {3} for chunk {5} to "
    "stage {4}";
constexpr const char* kNeverSentChunkGradient =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never sent the gradient of micro-batch {3} for chunk {5} to "
    "stage {4}";
constexpr const char* kNeverReceivedChunkActivation =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never received the activation of micro-batch {3} for chunk {5} "
    "from stage {4}";
constexpr const char* kNeverReceivedChunkGradient =
    "pipeline: stage {0} (world rank {1}, {6} index {2}) never received the gradient of micro-batch {3} for chunk {5} "
    "from stage {4}";

}  // namespace

StageBoundary::StageBoundary(Communicator& pp, int64_t rows, int64_t h, DType dtype, StepTimer& timer, int chunks)
    : pp_(pp),
      stage_(pp.rank()),
      stages_(pp.size()),
      chunks_(chunks),
      rows_(rows),
      h_(h),
      dtype_(dtype),
      timer_(timer) {
  // Tags up to 4 p v + 2 (the side values' streams after the tensors').
  FP_CHECK(chunks >= 1 && 4 * stages_ * chunks + 2 < 32767, "a pipeline boundary of {} stages x {} chunks", stages_,
           chunks);
}

StageBoundary::~StageBoundary() {
  FP_CHECK(to_next_.empty() && to_prev_.empty() && activations_in_.empty() && gradients_in_.empty(),
           "stage {}: a pipeline step ended with {} sends and {} receives in flight", stage_,
           to_next_.size() + to_prev_.size(), activations_in_.size() + gradients_in_.size());
}

CommPurpose StageBoundary::purpose(bool receive, BoundaryDirection direction, int i, int peer, int for_chunk) const {
  const bool activation = direction == BoundaryDirection::kActivation;
  CommPurpose p;
  if (chunks_ == 1)
    p.format = receive ? (activation ? kNeverSentActivation : kNeverSentGradient)
                       : (activation ? kNeverReceivedActivation : kNeverReceivedGradient);
  else
    p.format = receive ? (activation ? kNeverSentChunkActivation : kNeverSentChunkGradient)
                       : (activation ? kNeverReceivedChunkActivation : kNeverReceivedChunkGradient);
  p.args = {peer, pp_.world_ranks()[peer], place_.index, i, stage_, for_chunk};
  p.text = place_.axis;
  return p;
}

int StageBoundary::tag(BoundaryDirection direction, int sender_chunk) const {
  if (chunks_ == 1) return 0;
  return 1 + 2 * sender_chunk + (direction == BoundaryDirection::kActivation ? 0 : 1);
}

// Contiguous stages: the tensors' stream (tag 0, which NCCL can carry): each side message is
// posted right after its tensor on both ends, so in-order matching pairs them. Interleaved:
// a stream of its own per (direction, sending chunk).
int StageBoundary::side_tag(BoundaryDirection direction, int sender_chunk) const {
  if (chunks_ == 1) return 0;
  return 2 * stages_ * chunks_ + 1 + 2 * sender_chunk + (direction == BoundaryDirection::kActivation ? 0 : 1);
}

void StageBoundary::wait(Transfer& t) {
  timer_.wait(t.request);
  if (t.side.defined()) timer_.wait(t.side_request);
}

void StageBoundary::poke(Transfer& t) {
  StepTimer::poke(t.request);
  if (t.side.defined()) StepTimer::poke(t.side_request);
}

void StageBoundary::post_recv(std::map<Key, Transfer>& pending, int i, int c, BoundaryDirection direction) {
  const Key key{c, i};
  if (pending.count(key) != 0) return;
  const bool activation = direction == BoundaryDirection::kActivation;
  const int source = (stage_ + (activation ? stages_ - 1 : 1)) % stages_;
  const int g = global_chunk(c), sender = activation ? g - 1 : g + 1;
  Transfer t{Tensor::empty({rows_, h_}, dtype_, MemCategory::kComm), CommRequest(), Tensor(), CommRequest()};
  CommOp op;
  op.kind = CommOpKind::kRecv;
  op.recv_buf = t.buffer.raw_data();
  op.count = static_cast<size_t>(t.buffer.numel());
  op.dtype = dtype_;
  op.source = source;
  op.tag = tag(direction, sender);
  op.purpose = purpose(/*receive=*/true, direction, i, source, g);
  t.request = pp_.start(op);
  if (const int64_t n = side_values(direction); n > 0) {
    t.side = Tensor::empty({n}, DType::kF64, MemCategory::kComm);
    op.recv_buf = t.side.raw_data();
    op.count = static_cast<size_t>(n);
    op.dtype = DType::kF64;
    op.tag = side_tag(direction, sender);
    t.side_request = pp_.start(op);
  }
  pending.emplace(key, std::move(t));
}

Tensor StageBoundary::take(std::map<Key, Transfer>& pending, int i, int c, BoundaryDirection direction,
                           Tensor* side) {
  post_recv(pending, i, c, direction);
  auto it = pending.find(Key{c, i});
  wait(it->second);
  if (side != nullptr) *side = std::move(it->second.side);
  Tensor buffer = std::move(it->second.buffer);
  pending.erase(it);
  return buffer;
}

// At most p sends of a direction are kept. Waiting for the oldest never waits on a receive
// its peer posts later: under 1F1B, by the time stage s sends micro-batch j's activation it
// has taken the gradient of j - (p - s) >= j - p, which stage s+1 computed after receiving
// activation j - p; and by the time it sends j's gradient, stage s-1 has sent it activation
// j, which under 1F1B comes after s-1 took gradient j - (p - s + 1) >= j - p. ZB-H1 orders
// its F and B ops as 1F1B does and its W ops move nothing, so the same holds there.
void StageBoundary::send(std::deque<Transfer>& in_flight, Tensor t, Tensor side, int i, int c,
                         BoundaryDirection direction) {
  FP_CHECK(t.dtype() == dtype_ && t.numel() == rows_ * h_, "stage {}: sends {} across the boundary, expected {}[{}, {}]",
           stage_, t.describe(), dtype_name(dtype_), rows_, h_);
  const int64_t n = side_values(direction);
  FP_CHECK(n == 0 ? !side.defined() : side.defined() && side.dtype() == DType::kF64 && side.numel() == n,
           "stage {}: sends {} side values across the boundary, expected f64[{}]", stage_,
           side.defined() ? side.describe() : std::string("none"), n);
  if (hooks_ != nullptr && hooks_->before_send) hooks_->before_send(direction, i);
  const bool activation = direction == BoundaryDirection::kActivation;
  const int peer = (stage_ + (activation ? 1 : stages_ - 1)) % stages_;
  const int g = global_chunk(c);
  Transfer s{std::move(t), CommRequest(), Tensor(), CommRequest()};
  CommOp op;
  op.kind = CommOpKind::kSend;
  op.send_buf = s.buffer.raw_data();
  op.count = static_cast<size_t>(s.buffer.numel());
  op.dtype = dtype_;
  op.peer = peer;
  op.tag = tag(direction, g);
  op.purpose = purpose(/*receive=*/false, direction, i, peer, activation ? g + 1 : g - 1);
  s.request = pp_.start(op);
  if (n > 0) {
    s.side = std::move(side);
    op.send_buf = s.side.raw_data();
    op.count = static_cast<size_t>(n);
    op.dtype = DType::kF64;
    op.tag = side_tag(direction, g);
    s.side_request = pp_.start(op);
  }
  in_flight.push_back(std::move(s));
  while (static_cast<int>(in_flight.size()) > stages_) {
    wait(in_flight.front());
    in_flight.pop_front();
  }
}

void StageBoundary::post_activation_recv(int i, int c) {
  if (!first_chunk(c)) post_recv(activations_in_, i, c, BoundaryDirection::kActivation);
}

void StageBoundary::post_gradient_recv(int i, int c) {
  if (!last_chunk(c)) post_recv(gradients_in_, i, c, BoundaryDirection::kGradient);
}

Tensor StageBoundary::take_activation(int i, int c, Tensor* side) {
  FP_CHECK(!first_chunk(c), "the first chunk receives no activation");
  return take(activations_in_, i, c, BoundaryDirection::kActivation, side);
}

Tensor StageBoundary::take_gradient(int i, int c, Tensor* side) {
  FP_CHECK(!last_chunk(c), "the last chunk receives no gradient");
  return take(gradients_in_, i, c, BoundaryDirection::kGradient, side);
}

void StageBoundary::send_activation(int i, Tensor x, int c, Tensor side) {
  FP_CHECK(!last_chunk(c), "the last chunk sends no activation");
  send(to_next_, std::move(x), std::move(side), i, c, BoundaryDirection::kActivation);
}

void StageBoundary::send_gradient(int i, Tensor dx, int c, Tensor side) {
  FP_CHECK(!first_chunk(c), "the first chunk sends no gradient");
  send(to_prev_, std::move(dx), std::move(side), i, c, BoundaryDirection::kGradient);
}

void StageBoundary::progress() {
  for (std::map<Key, Transfer>* in : {&activations_in_, &gradients_in_})
    for (auto& [i, t] : *in) poke(t);
  for (std::deque<Transfer>* q : {&to_next_, &to_prev_})
    for (Transfer& s : *q) poke(s);
}

void StageBoundary::finish() {
  FP_CHECK(activations_in_.empty() && gradients_in_.empty(), "stage {}: {} receives posted and never taken", stage_,
           activations_in_.size() + gradients_in_.size());
  for (std::deque<Transfer>* q : {&to_next_, &to_prev_}) {
    for (Transfer& s : *q) wait(s);
    q->clear();
  }
}

}  // namespace foldpar
