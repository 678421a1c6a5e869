// PipelineDecoder: the stage's StageDecoder driven through the pipelined groups of prefill
// and of each decode step, the boundary moves between stages and the logits broadcast over pp.
#include "parallel/pipeline/pipeline_decoder.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>

#include "parallel/strategies.h"

namespace foldpar {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A group's rows x [n, h] padded with zero rows to the boundary's [rows, h].
Tensor pad_rows(Backend& be, const Tensor& x, int64_t rows) {
  if (x.dim(0) == rows) return x;
  Tensor padded = Tensor::empty({rows, x.dim(1)}, DType::kF32, MemCategory::kComm);
  be.fill(0.0, padded);
  Tensor head = padded.narrow(0, x.dim(0));
  be.copy(x, head);
  return padded;
}

}  // namespace

std::vector<int64_t> decode_groups(int64_t batch, int stages) {
  const int64_t G = std::min<int64_t>(batch, stages);
  std::vector<int64_t> bounds{0};
  for (int64_t g = 0; g < G; ++g) bounds.push_back(bounds.back() + batch / G + (g < batch % G ? 1 : 0));
  return bounds;
}

Result<std::unique_ptr<PipelineDecoder>> PipelineDecoder::create(const LlamaConfig& config, Communicator& pp,
                                                                 std::unique_ptr<StageDecoder> stage,
                                                                 const Layout& layout) {
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, 0));
  if (pp.size() != layout.pp)
    return invalid_argument("layout {} has {} pipeline stages, the pp communicator {} ranks", layout.to_string(),
                            layout.pp, pp.size());
  return std::unique_ptr<PipelineDecoder>(new PipelineDecoder(config, pp, std::move(stage), layout));
}

PipelineDecoder::PipelineDecoder(const LlamaConfig& config, Communicator& pp, std::unique_ptr<StageDecoder> stage,
                                 const Layout& layout)
    : config_(config),
      pp_(pp),
      stage_(std::move(stage)),
      name_(layout.to_string()),
      stage_index_(pp.rank()),
      stages_(pp.size()) {}

std::vector<ParamRef> PipelineDecoder::parameters() {
  std::vector<ParamRef> refs = stage_->parameters();
  // The last stage's copy of a tied embedding: stage 0 speaks for it (as PipelineModel).
  if (config_.tie_word_embeddings && stages_ > 1 && !stage_->layers().embed)
    for (ParamRef& r : refs)
      if (r.name == "embed") r.counted = false;
  return refs;
}

void PipelineDecoder::configure(StageBoundary& boundary) {
  Communicator& axis = stage_->weight_axis();
  boundary.set_place({axis.name().c_str(), axis.rank()});
  boundary.set_hooks(&hooks_);
}

void PipelineDecoder::share_logits(Tensor& logits, StepTimer& timer) {
  if (stages_ == 1) return;
  const auto t0 = Clock::now();
  timer.blocking(pp_.broadcast(logits.raw_data(), static_cast<size_t>(logits.numel()), DType::kF32, stages_ - 1), t0);
}

Tensor PipelineDecoder::run_groups(Backend& be, int64_t rows_per_seq, const GroupLayers& layers,
                                   const GroupHead& head, StepTimer& timer) {
  const int64_t B = groups_.back();
  const int G = static_cast<int>(groups_.size()) - 1;
  int64_t widest = 0;
  for (int g = 0; g < G; ++g) widest = std::max(widest, groups_[g + 1] - groups_[g]);
  Tensor logits = Tensor::empty({B, config_.vocab_size}, DType::kF32, MemCategory::kActivations);
  {
    StageBoundary boundary(pp_, widest * rows_per_seq, config_.hidden_size, DType::kF32, timer);
    configure(boundary);
    boundary.post_activation_recv(0);
    // Group g here while the previous stage runs group g+1: the receive of g+1 is posted
    // before g's layers, the send of g starts right after them.
    for (int g = 0; g < G; ++g) {
      const int64_t b0 = groups_[g], b1 = groups_[g + 1];
      if (g + 1 < G) boundary.post_activation_recv(g + 1);
      Tensor x = boundary.first() ? Tensor() : boundary.take_activation(g).narrow(0, (b1 - b0) * rows_per_seq);
      x = layers(b0, b1, std::move(x));
      if (boundary.last()) {
        Tensor rows = logits.narrow(b0, b1);
        be.copy(head(b0, b1, x), rows);
      } else {
        boundary.send_activation(g, pad_rows(be, x, widest * rows_per_seq));
      }
      boundary.progress();
    }
    boundary.finish();
  }
  share_logits(logits, timer);
  return logits;
}

Result<Tensor> PipelineDecoder::prefill(Backend& be, const std::vector<std::vector<int32_t>>& prompts,
                                        int64_t max_new) {
  FP_RETURN_IF_ERROR(validate_prompts(config_, prompts, max_new));
  const auto t0 = Clock::now();
  const double blocked0 = stage_->blocked_seconds();
  FP_ASSIGN_OR_RETURN(const int64_t rows_per_seq, stage_->start_prefill(be, prompts, max_new));
  groups_ = decode_groups(static_cast<int64_t>(prompts.size()), stages_);
  StepTimer timer;
  Tensor logits = run_groups(
      be, rows_per_seq, [&](int64_t b0, int64_t b1, Tensor x) { return stage_->prefill(be, b0, b1, std::move(x)); },
      [&](int64_t b0, int64_t b1, const Tensor& x) { return stage_->prefill_logits(be, b0, b1, x); }, timer);
  lengths_.clear();
  for (const auto& p : prompts) lengths_.push_back(static_cast<int64_t>(p.size()));
  decoded_ = 0;
  max_new_ = max_new;
  times_.prefill_seconds += since(t0);
  times_.prefill_comm_seconds += timer.seconds() + stage_->blocked_seconds() - blocked0;
  return logits;
}

Result<Tensor> PipelineDecoder::decode(Backend& be, std::span<const int32_t> tokens) {
  const int64_t B = static_cast<int64_t>(lengths_.size());
  FP_RETURN_IF_ERROR(validate_decode_tokens(config_, tokens, B, decoded_, max_new_));
  const auto t0 = Clock::now();
  const double blocked0 = stage_->blocked_seconds();
  stage_->start_decode(be);
  const bool first = stage_->layers().embed;
  StepTimer timer;
  Tensor logits = run_groups(
      be, 1,
      [&](int64_t b0, int64_t b1, Tensor x) {
        if (first) x = stage_->decode_embed(be, tokens.subspan(b0, b1 - b0));
        return stage_->decode_layers(be, b0, b1, std::move(x));
      },
      [&](int64_t, int64_t, const Tensor& x) { return stage_->decode_logits(be, x); }, timer);
  stage_->finish_decode();
  for (int64_t& n : lengths_) ++n;
  ++decoded_;
  times_.decode_seconds += since(t0);
  times_.decode_comm_seconds += timer.seconds() + stage_->blocked_seconds() - blocked0;
  return logits;
}

namespace {

// What crosses a boundary in flight: the group's rows x [n, h] padded to [rows, h], then the
// flag row (1 ends the decoding).
Tensor flagged_rows(Backend& be, const Tensor& x, int64_t rows, int64_t h, bool end) {
  Tensor msg = Tensor::empty({rows + 1, h}, DType::kF32, MemCategory::kComm);
  be.fill(0.0, msg);
  if (x.defined()) {
    Tensor head = msg.narrow(0, x.dim(0));
    be.copy(x, head);
  }
  if (end) {
    Tensor flag = msg.narrow(rows, rows + 1);
    be.fill(1.0, flag);
  }
  return msg;
}

bool end_flag(Backend& be, const Tensor& msg) {
  std::vector<float> row(static_cast<size_t>(msg.dim(1)));
  be.copy_to_host(msg.narrow(msg.dim(0) - 1, msg.dim(0)), std::as_writable_bytes(std::span<float>(row)));
  return row[0] != 0;
}

}  // namespace

Result<int64_t> PipelineDecoder::decode_in_flight(Backend& be, std::span<const int32_t> first_tokens,
                                                  const GroupChooser& choose) {
  const int64_t B = static_cast<int64_t>(lengths_.size());
  FP_RETURN_IF_ERROR(validate_decode_tokens(config_, first_tokens, B, decoded_, max_new_));
  if (!decodes_in_flight(B))
    return invalid_argument("layout {}: {} sequences cannot keep {} pipeline stages busy (need B >= p)", name_, B,
                            stages_);
  Communicator& axis = stage_->weight_axis();
  const bool sampler = stage_index_ == 0 && axis.rank() == 0;
  FP_CHECK(sampler == static_cast<bool>(choose), "stage {} rank {} of {}: the sampler runs on stage 0's first rank only",
           stage_index_, axis.rank(), axis.name());
  const auto t0 = Clock::now();
  const double blocked0 = stage_->blocked_seconds();
  groups_ = decode_groups(B, stages_);
  const int G = static_cast<int>(groups_.size()) - 1;  // = p
  int64_t widest = 0;
  for (int g = 0; g < G; ++g) widest = std::max(widest, groups_[g + 1] - groups_[g]);
  const int64_t h = config_.hidden_size, V = config_.vocab_size;
  std::vector<int32_t> tokens(first_tokens.begin(), first_tokens.end());
  // Decode steps each group may still take: the cache holds max_new_ - decoded_ more tokens.
  const int64_t steps_left = max_new_ - decoded_;
  int64_t computed = 0;
  StepTimer timer;
  {
    StageBoundary boundary(pp_, widest + 1, h, DType::kF32, timer);
    configure(boundary);
    struct Sent {
      Tensor buffer;
      CommRequest request;
    };
    std::deque<Sent> logits_out;  // last stage's first rank: the logits sent to stage 0
    auto wait_logits = [&](size_t keep) {
      while (logits_out.size() > keep) {
        timer.wait(logits_out.front().request);
        logits_out.pop_front();
      }
    };
    Tensor logits_in;  // stage 0's first rank
    auto recv_logits = [&]() {
      logits_in = Tensor::empty({widest, V}, DType::kF32, MemCategory::kComm);
      const auto tw = Clock::now();
      timer.blocking(pp_.recv(logits_in.raw_data(), static_cast<size_t>(widest * V), DType::kF32, stages_ - 1), tw);
    };
    if (!boundary.first()) boundary.post_activation_recv(0);
    for (int64_t i = 0;; ++i) {
      const int g = static_cast<int>(i % G);
      const int64_t k = i / G, b0 = groups_[g], b1 = groups_[g + 1], n = b1 - b0;
      Tensor x;
      if (boundary.first()) {
        bool end = false;
        if (k > 0) {  // group g's next tokens from its logits of step k - 1, item i - G
          std::vector<int32_t> msg(static_cast<size_t>(n + 1), 0);
          if (sampler) {
            recv_logits();
            std::span<int32_t> out(tokens.data() + b0, static_cast<size_t>(n));
            end = choose(b0, logits_in.narrow(0, n), out);
            std::copy(out.begin(), out.end(), msg.begin());
            msg[static_cast<size_t>(n)] = end ? 1 : 0;
          }
          if (axis.size() > 1) {
            const auto tw = Clock::now();
            timer.blocking(axis.broadcast(msg.data(), msg.size(), DType::kI32, 0), tw);
          }
          std::copy(msg.begin(), msg.begin() + n, tokens.begin() + b0);
          end = msg[static_cast<size_t>(n)] != 0;
        }
        FP_CHECK(end || k < steps_left, "decoding in flight: group {} would take step {} of a cache for {}", g, k + 1,
                 steps_left);
        if (end) {
          boundary.send_activation(i, flagged_rows(be, Tensor(), widest, h, true));
          // The logits of the items still in flight (i - G + 1 .. i - 1) arrive and are dropped.
          if (sampler)
            for (int j = 1; j < G; ++j) recv_logits();
          break;
        }
        if (g == 0) stage_->start_decode(be);
        x = stage_->decode_embed(be, std::span<const int32_t>(tokens.data() + b0, static_cast<size_t>(n)));
      } else {
        Tensor in = boundary.take_activation(i);
        if (end_flag(be, in)) {
          if (!boundary.last()) boundary.send_activation(i, std::move(in));
          break;
        }
        boundary.post_activation_recv(i + 1);
        if (g == 0) stage_->start_decode(be);
        x = in.narrow(0, n);
      }
      x = stage_->decode_layers(be, b0, b1, std::move(x));
      computed += n;
      if (boundary.last()) {
        Tensor logits = stage_->decode_logits(be, x);
        if (axis.rank() == 0) {
          Sent t{pad_rows(be, logits, widest), CommRequest()};
          t.request = pp_.isend(t.buffer.raw_data(), static_cast<size_t>(widest * V), DType::kF32, 0);
          logits_out.push_back(std::move(t));
          wait_logits(static_cast<size_t>(stages_));
        }
      } else {
        boundary.send_activation(i, flagged_rows(be, x, widest, h, false));
      }
      for (int64_t b = b0; b < b1; ++b) ++lengths_[static_cast<size_t>(b)];
      if (g == G - 1) stage_->finish_decode();
      boundary.progress();
    }
    wait_logits(0);
    boundary.finish();
  }
  decoded_ = max_new_;  // the groups stopped at different steps: decode() waits for the next prefill
  times_.decode_seconds += since(t0);
  times_.decode_comm_seconds += timer.seconds() + stage_->blocked_seconds() - blocked0;
  return computed;
}

Result<std::unique_ptr<ShardedDecoder>> make_pipeline_decoder(const LlamaConfig& config, Communicator& pp,
                                                              std::unique_ptr<StageDecoder> stage,
                                                              const Layout& layout) {
  FP_ASSIGN_OR_RETURN(std::unique_ptr<PipelineDecoder> d, PipelineDecoder::create(config, pp, std::move(stage), layout));
  return std::unique_ptr<ShardedDecoder>(std::move(d));
}

}  // namespace foldpar
