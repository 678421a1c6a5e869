// StageBoundary: the non-blocking point-to-point transfers between neighbouring stages.
#include "parallel/pipeline/pipeline_boundary.h"

#include <algorithm>

#include "core/check.h"

namespace foldpar {

StageBoundary::StageBoundary(Communicator& pp, int64_t rows, int64_t h, DType dtype, StepTimer& timer)
    : pp_(pp), stage_(pp.rank()), stages_(pp.size()), rows_(rows), h_(h), dtype_(dtype), timer_(timer) {}

StageBoundary::~StageBoundary() {
  FP_CHECK(sends_.empty() && activations_in_.empty() && gradients_in_.empty(),
           "stage {}: a pipeline step ended with {} sends and {} receives in flight", stage_, sends_.size(),
           activations_in_.size() + gradients_in_.size());
}

void StageBoundary::post_recv(std::map<int, Transfer>& pending, int i, int source) {
  if (pending.count(i) != 0) return;
  Transfer t{Tensor::empty({rows_, h_}, dtype_, MemCategory::kComm), CommRequest()};
  t.request = pp_.irecv(t.buffer.raw_data(), static_cast<size_t>(t.buffer.numel()), dtype_, source);
  pending.emplace(i, std::move(t));
}

Tensor StageBoundary::take(std::map<int, Transfer>& pending, int i, int source) {
  post_recv(pending, i, source);
  auto it = pending.find(i);
  timer_.wait(it->second.request);
  Tensor buffer = std::move(it->second.buffer);
  pending.erase(it);
  return buffer;
}

void StageBoundary::send(Tensor t, int peer) {
  FP_CHECK(t.dtype() == dtype_ && t.numel() == rows_ * h_, "stage {}: sends {} across the boundary, expected {}[{}, {}]",
           stage_, t.describe(), dtype_name(dtype_), rows_, h_);
  Transfer s{std::move(t), CommRequest()};
  s.request = pp_.isend(s.buffer.raw_data(), static_cast<size_t>(s.buffer.numel()), dtype_, peer);
  sends_.push_back(std::move(s));
}

void StageBoundary::post_activation_recv(int i) {
  if (!first()) post_recv(activations_in_, i, stage_ - 1);
}

void StageBoundary::post_gradient_recv(int i) {
  if (!last()) post_recv(gradients_in_, i, stage_ + 1);
}

Tensor StageBoundary::take_activation(int i) {
  FP_CHECK(!first(), "the first stage receives no activation");
  return take(activations_in_, i, stage_ - 1);
}

Tensor StageBoundary::take_gradient(int i) {
  FP_CHECK(!last(), "the last stage receives no gradient");
  return take(gradients_in_, i, stage_ + 1);
}

void StageBoundary::send_activation(int /*i*/, Tensor x) {
  FP_CHECK(!last(), "the last stage sends no activation");
  send(std::move(x), stage_ + 1);
}

void StageBoundary::send_gradient(int /*i*/, Tensor dx) {
  FP_CHECK(!first(), "the first stage sends no gradient");
  send(std::move(dx), stage_ - 1);
}

void StageBoundary::progress() {
  for (auto& [i, t] : activations_in_) StepTimer::poke(t.request);
  for (auto& [i, t] : gradients_in_) StepTimer::poke(t.request);
  for (Transfer& s : sends_) {
    bool done = false;
    FP_CHECK_OK(s.request.test(&done));
    if (done) s.request = CommRequest();
  }
  std::erase_if(sends_, [](const Transfer& s) { return !s.request.pending(); });
}

void StageBoundary::finish() {
  FP_CHECK(activations_in_.empty() && gradients_in_.empty(), "stage {}: {} receives posted and never taken", stage_,
           activations_in_.size() + gradients_in_.size());
  for (Transfer& s : sends_) timer_.wait(s.request);
  sends_.clear();
}

}  // namespace foldpar
