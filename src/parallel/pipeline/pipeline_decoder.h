// PipelineDecoder: generation under pipeline parallelism (docs/composition.md section 2,
// "Generation"), behind ShardedDecoder. Stage s = pp.rank() holds decoder layers
// [bounds[s], bounds[s+1]) (layout/stage_bounds, as training's PipelineModel), the embedding
// on stage 0 and the final norm + LM head on stage p-1, under their global names (so
// load_checkpoint and the Hugging Face loader fill them as in training), and the KV cache of
// its layers; the stage's model axis runs its StageDecoder (parallel/stage_decoder.h: tsp/, or
// megatron/ for tp stages).
// Prefill and every decode step run the B sequences in G = min(B, p) groups of consecutive
// sequences, pipelined: group g runs on stage s while group g+1 runs on stage s-1. What
// crosses to the next stage (StageBoundary, as in training) is padded to the largest group,
// so the boundary's shape is static:
//   prefill  each TSP rank's [n*S/D, h] rows of the group's n prompts (padded to the
//            batch's S) to the same TSP index of the next stage;
//   decode   the group's [n, h] rows, one new token per sequence.
// The last stage's logits [B, V] are broadcast over pp, so every rank returns the same.
// The watchdog names a missing neighbour as training's boundary does (stage, world rank,
// model-axis index, and the micro-batch: the group in decode, 0 in prefill).
//
// Collective over the pp communicator and the stage's model axis.
#pragma once

#include <functional>
#include <memory>

#include "layout/layout.h"
#include "parallel/pipeline/pipeline_boundary.h"
#include "parallel/sharded_decoder.h"
#include "parallel/stage_decoder.h"

namespace foldpar {

class PipelineDecoder final : public ShardedDecoder {
 public:
  // validate_layout's verdict first (pp = layout.pp = pp.size()); `stage` built over
  // stage_layers(config, layout, pp.rank()). Not collective.
  static Result<std::unique_ptr<PipelineDecoder>> create(const LlamaConfig& config, Communicator& pp,
                                                         std::unique_ptr<StageDecoder> stage, const Layout& layout);

  const std::string& layout() const override { return name_; }
  std::vector<ParamRef> parameters() override;
  void init_weights(const InitOptions& options) override { stage_->init_weights(options); }
  Result<Tensor> prefill(Backend& backend, const std::vector<std::vector<int32_t>>& prompts,
                         int64_t max_new_tokens) override;
  Result<Tensor> decode(Backend& backend, std::span<const int32_t> tokens) override;
  // G = p groups (B >= p) stay in flight across steps: stage s works on group (t - s) mod p
  // at slot t, the sampler on stage 0's first rank between a group's logits (sent from the
  // last stage's first rank, [widest, V]) and its next tokens (broadcast over stage 0's
  // model axis). What crosses a boundary carries one row more, a flag: 1 ends the decoding
  // (sent by stage 0 when the sampler says every sequence has finished, forwarded by every
  // stage), so no stage needs another message to know when to stop.
  bool decodes_in_flight(int64_t batch) const override { return stages_ > 1 && batch >= stages_; }
  Result<int64_t> decode_in_flight(Backend& backend, std::span<const int32_t> tokens,
                                   const GroupChooser& choose) override;
  int64_t sequence_length(int64_t b) const override {
    return lengths_.empty() ? 0 : lengths_[static_cast<size_t>(b)];
  }
  const KvCache& cache() const override { return stage_->cache(); }  // this stage's layers
  DecoderTimes times() const override { return times_; }

  // The groups: [groups()[g], groups()[g+1]) are group g's sequences (empty before prefill).
  const std::vector<int64_t>& groups() const { return groups_; }
  // Fault injection for tests: the boundary calls these in every later phase.
  void set_boundary_hooks(BoundaryHooks hooks) { hooks_ = std::move(hooks); }

 private:
  PipelineDecoder(const LlamaConfig& config, Communicator& pp, std::unique_ptr<StageDecoder> stage,
                  const Layout& layout);
  void configure(StageBoundary& boundary);
  // One pass of the groups through the stages: on this stage `layers`(b0, b1, x) for each
  // group (x: the previous stage's rows for it, [(b1-b0) rows_per_seq, h]; undefined on the
  // first stage), then on the last stage `head` -> the group's logits rows [b1-b0, V], else
  // the send. Returns [B, V] on every rank (share_logits).
  using GroupLayers = std::function<Tensor(int64_t b0, int64_t b1, Tensor x)>;
  using GroupHead = std::function<Tensor(int64_t b0, int64_t b1, const Tensor& x)>;
  Tensor run_groups(Backend& backend, int64_t rows_per_seq, const GroupLayers& layers, const GroupHead& head,
                    StepTimer& timer);
  // The last stage's logits [B, V] to every stage (a broadcast over pp).
  void share_logits(Tensor& logits, StepTimer& timer);

  LlamaConfig config_;
  Communicator& pp_;
  std::unique_ptr<StageDecoder> stage_;
  std::string name_;
  int stage_index_ = 0, stages_ = 1;
  std::vector<int64_t> lengths_;  // [B]: tokens so far
  std::vector<int64_t> groups_;   // G + 1 bounds (decode_groups)
  int64_t decoded_ = 0, max_new_ = 0;
  DecoderTimes times_;
  BoundaryHooks hooks_;
};

// The groups of B sequences over p stages: G = min(B, p) groups of consecutive
// sequences, sizes differing by at most one (larger first); returns the G + 1 bounds.
std::vector<int64_t> decode_groups(int64_t batch, int stages);

}  // namespace foldpar
