// The training loop. run_training's phases, in order: plan_batches (the dp split and the
// micro-batches), open_data, build_learner (model and AdamW), restore_state (--resume or
// --init-from), open_outputs (metrics, progress), choose_backend; then per step train_step,
// metrics_line, validate when due and save_checkpoint when due.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/bf16_storage_backend.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_directory.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "core/check.h"
#include "data/corpus.h"
#include "data/data_loader.h"
#include "parallel/failed_ranks.h"
#include "parallel/make_layout.h"
#include "train/progress.h"

namespace foldpar {
namespace fs = std::filesystem;
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Setup {
  int dp = 1, dp_rank = 0;
  Communicator* dp_comm = nullptr;
  int64_t rows_per_dp = 0, micro = 0, accum = 0;
};

Result<Setup> plan_batches(const TrainOptions& o, Mesh& mesh) {
  Setup s;
  if (mesh.has_axis("dp")) {
    s.dp_comm = &mesh.comm("dp");
    s.dp = s.dp_comm->size();
    s.dp_rank = s.dp_comm->rank();
  }
  if (o.batch <= 0 || o.batch % s.dp != 0)
    return invalid_argument("--batch ({}) must be a positive multiple of the data-parallel degree ({})", o.batch, s.dp);
  s.rows_per_dp = o.batch / s.dp;
  s.micro = o.micro_batch > 0 ? o.micro_batch : s.rows_per_dp;
  if (s.rows_per_dp % s.micro != 0)
    return invalid_argument("--micro-batch ({}) must divide the sequences per data-parallel rank ({} = {} / {})", s.micro,
                            s.rows_per_dp, o.batch, s.dp);
  s.accum = s.rows_per_dp / s.micro;
  return s;
}

// The pipeline's micro-batches are the accumulation's (m = accum): refused below p stages.
Status check_micro_batches(const Layout& lo, const Setup& s) {
  return validate_micro_batches(lo, s.accum);
}

double sum_over(Communicator& comm, double x) {
  FP_CHECK_OK(comm.all_reduce(&x, &x, 1, DType::kF64, ReduceOp::kSum));
  return x;
}

// Mean validation loss over `batches` batches of sequential windows, split over dp.
Result<double> validate(ShardedModel& model, Backend& be, const DataLoader& val, const TrainOptions& o, const Setup& s,
                        Communicator& world) {
  double loss_sum = 0, valid = 0;
  for (int64_t k = 0; k < o.eval_batches; ++k) {
    const int64_t r0 = s.dp_rank * s.rows_per_dp;
    for (int64_t a = 0; a < s.accum; ++a) {
      const Batch rows = val.sequential_rows(static_cast<uint64_t>(k), o.batch, r0 + a * s.micro, r0 + (a + 1) * s.micro);
      FP_ASSIGN_OR_RETURN(StepResult r, model.forward(be, model.local_batch(rows)));
      loss_sum += r.loss_sum;
      valid += static_cast<double>(r.valid_tokens);
    }
  }
  // Sums over the model axes are already global; add up the data-parallel replicas.
  const double dp = s.dp;
  loss_sum = sum_over(world, loss_sum) / (static_cast<double>(world.size()) / dp);
  valid = sum_over(world, valid) / (static_cast<double>(world.size()) / dp);
  return valid > 0 ? loss_sum / valid : 0.0;
}

// Every rank's tracked peaks per category, bytes sent, and the step's explicit host copies
// (host_in, host_out: what crosses the bus where tensors are device memory), for the
// metrics line.
nlohmann::json per_rank_counters(Communicator& world, const MemoryStats& mem, int64_t bytes_sent, int64_t host_in,
                                 int64_t host_out) {
  std::array<int64_t, kNumMemCategories + 4> mine{};
  for (int c = 0; c < kNumMemCategories; ++c) mine[static_cast<size_t>(c)] = mem.peak[static_cast<size_t>(c)];
  mine[kNumMemCategories] = mem.peak_total;
  mine[kNumMemCategories + 1] = bytes_sent;
  mine[kNumMemCategories + 2] = host_in;
  mine[kNumMemCategories + 3] = host_out;
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(world.size()));
  FP_CHECK_OK(world.all_gather(mine.data(), all.data(), mine.size(), DType::kI64));
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < world.size(); ++r) {
    nlohmann::json j;
    const int64_t* v = all.data() + static_cast<size_t>(r) * mine.size();
    for (int c = 0; c < kNumMemCategories; ++c) j["peak_" + std::string(mem_category_name(static_cast<MemCategory>(c)))] = v[c];
    j["peak_total"] = v[kNumMemCategories];
    j["bytes_sent"] = v[kNumMemCategories + 1];
    j["host_bytes_in"] = v[kNumMemCategories + 2];
    j["host_bytes_out"] = v[kNumMemCategories + 3];
    ranks.push_back(j);
  }
  return ranks;
}

// A NaN or Inf stops every rank before the optimizer touches the weights and before any
// checkpoint is written; the message names the step, the first tensor and every rank that
// saw one.
Status check_finite(Communicator& world, int64_t step, double loss, const std::string& bad_tensor) {
  const bool mine = !bad_tensor.empty();
  const std::vector<int> ranks = failed_ranks(world, mine);
  if (!ranks.empty()) {
    const std::string where = mine ? fmt::format(": the gradient of {} on this rank ({})", bad_tensor, process_identity())
                                   : std::string();
    return diverged("step {}: non-finite gradients on rank(s) {}{}; stopped before the update, the last "
                    "checkpoint is untouched", step, fmt::join(ranks, ", "), where);
  }
  if (!std::isfinite(loss))
    return diverged("step {}: the loss is {}; stopped before the update, the last checkpoint is untouched", step,
                    loss);
  return Status();
}

// The training and validation windows of the corpus, checked against the model's vocabulary.
struct Data {
  DataLoader train, val;
};

Result<Data> open_data(const TrainOptions& o) {
  FP_ASSIGN_OR_RETURN(CorpusInfo corpus, read_corpus_info(o.data_dir));
  if (corpus.vocab_size > static_cast<uint32_t>(o.config.vocab_size))
    return invalid_argument("the corpus has a vocabulary of {}, the model only {}", corpus.vocab_size,
                            o.config.vocab_size);
  FP_ASSIGN_OR_RETURN(TokenFile train_tokens, read_token_file(corpus.train_path));
  FP_ASSIGN_OR_RETURN(TokenFile val_tokens, read_token_file(corpus.val_path));
  FP_ASSIGN_OR_RETURN(DataLoader train, DataLoader::create(std::make_shared<TokenFile>(std::move(train_tokens)), o.seq, o.seed));
  FP_ASSIGN_OR_RETURN(DataLoader val, DataLoader::create(std::make_shared<TokenFile>(std::move(val_tokens)), o.seq, o.seed));
  return Data{std::move(train), std::move(val)};
}

// The model and its optimizer, at the step the run starts from.
struct Learner {
  std::unique_ptr<ShardedModel> model;
  std::vector<ParamRef> params;        // the model's (bf16 ones for bf16 storage)
  std::unique_ptr<AdamW> adamw;
  std::vector<ParamRef> saved_params;  // what checkpoints hold: f32 masters of bf16 parameters
  int64_t step = 0;                    // optimizer steps already taken
  std::string checkpoint;              // the checkpoint resumed from, if any
};

Result<Learner> build_learner(const TrainOptions& o, Mesh& mesh, const Layout& lo) {
  Learner l;
  FP_ASSIGN_OR_RETURN(l.model, make_sharded_model(o.config, mesh, o.seq, lo));
  l.model->init_weights(InitOptions{.seed = o.seed});
  l.params = l.model->parameters();
  l.adamw = std::make_unique<AdamW>(l.params, o.optimizer);
  l.saved_params = l.adamw->checkpoint_params();
  return l;
}

// --resume: the newest complete checkpoint in out_dir, if there is one (else a fresh start);
// --init-from: a Hugging Face directory's weights. Not collective.
Status restore_state(const TrainOptions& o, const std::string& ckpt_root, Learner& l) {
  if (o.resume) {
    Result<std::string> latest = latest_checkpoint(ckpt_root);
    if (!latest.ok()) return Status();
    FP_ASSIGN_OR_RETURN(CheckpointState st, read_checkpoint_state(*latest));
    FP_RETURN_IF_ERROR(load_checkpoint(*latest, o.config, l.saved_params, &l.adamw->first_moments(),
                                       &l.adamw->second_moments()));
    l.adamw->set_steps_taken(st.step);
    l.step = st.step;
    l.checkpoint = *latest;
  } else if (!o.init_from.empty()) {
    FP_RETURN_IF_ERROR(load_hf_weights(o.init_from, o.config, l.saved_params));
  }
  return Status();
}

// The borrowed backend, or the fast CPU one (decorated with bf16 storage for bf16 layouts).
struct Backends {
  std::unique_ptr<Backend> cpu, bf16;
  Backend* be = nullptr;
};

Backends choose_backend(const TrainOptions& o) {
  Backends b;
  b.be = o.backend;
  if (b.be == nullptr) {
    b.cpu = make_cpu_backend();
    if (o.layout && o.layout->dtype == DType::kBF16) b.bf16 = make_bf16_storage_backend(*b.cpu);
    b.be = b.bf16 ? b.bf16.get() : b.cpu.get();
  }
  return b;
}

// What one optimizer step measured.
struct StepStats {
  double loss = 0, grad_norm = 0, lr = 0;
  // MoE models: the aux term in `loss` (router_aux_loss_coef x the aux loss, 0 without
  // output_router_logits) and the tokens each expert received over the sparse layers, the
  // ranks and the micro-batches of the step; empty for a dense model.
  double aux_term = 0;
  std::vector<int64_t> expert_load;
  int64_t moe_dropped = 0;  // MoE: the pairs dropped over capacity, counted as the load is
  double seconds = 0;  // wall time of the step (set by the loop)
  int64_t host_bytes_in = 0, host_bytes_out = 0;  // this rank's explicit host copies in the step (set by the loop)
};

// One optimizer step: the micro-batches' forward and backward, the data-parallel gradient
// sum, the finiteness check (every rank stops together), clipping and AdamW. Collective.
Result<StepStats> train_step(const TrainOptions& o, const Setup& s, const DataLoader& train, Learner& l, Backend& be,
                             Communicator& world) {
  l.model->zero_grads(be);
  const uint64_t index = static_cast<uint64_t>(l.step);
  // The global batch's valid tokens (every rank can count them: the loader is counter-based).
  const Batch all_rows = train.train_rows(index, 0, o.batch);
  const int64_t normalizer = be.count_valid_targets(all_rows.target_ids, kIgnoreIndex);
  const int64_t r0 = s.dp_rank * s.rows_per_dp;
  std::vector<Batch> micro_batches;
  for (int64_t a = 0; a < s.accum; ++a)
    micro_batches.push_back(l.model->local_batch(train.train_rows(index, r0 + a * s.micro, r0 + (a + 1) * s.micro)));
  FP_ASSIGN_OR_RETURN(StepResult r, l.model->forward_backward_micro_batches(be, micro_batches, normalizer));
  const double loss_sum = r.loss_sum;
  Communicator* expert_dp = l.model->expert_data_axis();
  sum_grads_over_data_axis(s.dp_comm, l.params, expert_dp);
  StepStats st;
  // Loss sums are global over the model axes already; the dp replicas add theirs.
  const double model_ranks = static_cast<double>(world.size()) / s.dp;
  st.loss = sum_over(world, loss_sum) / model_ranks / std::max<double>(1.0, static_cast<double>(normalizer));
  const MoeConfig& moe = o.config.moe;
  if (moe.enabled()) {
    // Each replica's micro-batches weighted by their valid tokens, as loss_sum carries them;
    // the load is already global (summed over the model axes and dp inside the step).
    const double aux = sum_over(world, r.aux_loss * static_cast<double>(r.valid_tokens)) / model_ranks /
                       std::max<double>(1.0, static_cast<double>(normalizer));
    st.aux_term = moe.output_router_logits ? moe.router_aux_loss_coef * aux : 0.0;
    st.expert_load = r.expert_load;
    st.moe_dropped = r.moe_dropped;
  }
  // Every gradient's sum of squares in one call (one launch on the CUDA backend), then added
  // in parameter order, as one sum_squares per gradient was.
  std::vector<const Tensor*> grads;
  for (const ParamRef& p : l.params) grads.push_back(&p.grad);
  std::vector<double> sums(grads.size());
  be.sum_squares_many(grads, sums);
  double sq = 0;
  std::string bad_tensor;  // the first gradient on this rank that is not finite
  // Experts over dp replicas (Layout::ep): a routed expert is held by dp/K replicas, not dp,
  // so its square counts K times to come out once from the division by dp below.
  const double expert_weight = expert_dp != nullptr ? static_cast<double>(s.dp / expert_dp->size()) : 1.0;
  for (size_t i = 0; i < l.params.size(); ++i) {
    if (!std::isfinite(sums[i]) && bad_tensor.empty()) bad_tensor = l.params[i].name;
    if (l.params[i].counted) sq += l.params[i].routed_expert ? sums[i] * expert_weight : sums[i];
  }
  FP_RETURN_IF_ERROR(check_finite(world, l.step + 1, st.loss, bad_tensor));
  st.grad_norm = std::sqrt(sum_over(world, sq) / s.dp);  // every dp replica counted the same
  st.lr = learning_rate(o.optimizer, l.step + 1);
  l.adamw->step(be, st.lr, clip_scale(st.grad_norm, o.optimizer.grad_clip));
  ++l.step;
  return st;
}

// The metrics line of step `step` (1-based); the validation loss is added when measured.
// Collective over `world` (every rank's memory peaks and traffic).
nlohmann::ordered_json metrics_line(const TrainOptions& o, int64_t step, const StepStats& st, Communicator& world,
                                    uint64_t bytes_sent) {
  nlohmann::ordered_json line;
  line["step"] = step;
  line["loss"] = st.loss;
  line["lr"] = st.lr;
  line["grad_norm"] = st.grad_norm;
  if (o.config.moe.enabled()) {
    // The load-balancing term in `loss` and the loss without it; one count per expert (not
    // per layer), summed over the sparse layers, ranks and micro-batches: B S k per layer.
    line["aux_loss"] = st.aux_term;
    line["lm_loss"] = st.loss - st.aux_term;
    line["expert_load"] = st.expert_load;
    // The token-expert pairs that the capacity factor dropped (0 when dropless), of the
    // sum(expert_load) chosen.
    line["moe_dropped"] = st.moe_dropped;
  }
  line["tokens_per_s"] = static_cast<double>(o.batch * o.seq) / st.seconds;
  line["step_s"] = st.seconds;
  line["tokens"] = step * o.batch * o.seq;
  line["ranks"] = per_rank_counters(world, MemoryTracker::process().stats(), static_cast<int64_t>(bytes_sent),
                                    st.host_bytes_in, st.host_bytes_out);
  if (o.backend == nullptr) line["gemm_engine"] = cpu_gemm_engine_summary();
  return line;
}

// Where a run reports: metrics.jsonl and the progress on rank 0.
struct Outputs {
  MetricsFile metrics;
  ProgressLine progress;
  bool leader = false;
};

Result<Outputs> open_outputs(const TrainOptions& o, Communicator& world) {
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return io_error("cannot create '{}': {}", o.out_dir, ec.message());
  const bool leader = world.rank() == 0;
  FP_ASSIGN_OR_RETURN(MetricsFile metrics, MetricsFile::open(leader ? (fs::path(o.out_dir) / "metrics.jsonl").string() : ""));
  return Outputs{std::move(metrics), ProgressLine(o.steps, o.tty && leader, o.print_every), leader};
}

}  // namespace

Result<TrainReport> run_training(const TrainOptions& o, Communicator& world) {
  FP_RETURN_IF_ERROR(o.config.validate());
  FP_RETURN_IF_ERROR(o.optimizer.validate());
  if (o.steps <= 0 || o.seq <= 0) return invalid_argument("--steps ({}) and --seq ({}) must be positive", o.steps, o.seq);
  if (o.out_dir.empty()) return invalid_argument("an output directory is required");
  Layout lo = o.layout.value_or(tsp_layout(world.size()));
  lo.keep_logits = false;
  FP_RETURN_IF_ERROR(validate_layout(o.config, lo, o.batch, o.seq));
  const std::string layout = lo.to_string();
  FP_ASSIGN_OR_RETURN(Mesh mesh, Mesh::create(world, lo.mesh(), o.axis_comm));
  FP_ASSIGN_OR_RETURN(Setup s, plan_batches(o, mesh));
  FP_RETURN_IF_ERROR(check_micro_batches(lo, s));
  FP_ASSIGN_OR_RETURN(Data data, open_data(o));
  FP_ASSIGN_OR_RETURN(Learner l, build_learner(o, mesh, lo));
  const std::string ckpt_root = (fs::path(o.out_dir) / "checkpoints").string();
  FP_RETURN_IF_ERROR(restore_state(o, ckpt_root, l));
  FP_ASSIGN_OR_RETURN(Outputs out, open_outputs(o, world));
  Backends backends = choose_backend(o);
  Backend& be = *backends.be;
  l.adamw->sync_params(be);  // loaded masters -> bf16 parameters

  TrainReport report;
  report.checkpoint = l.checkpoint;
  std::vector<double> step_times;
  const double t_start = now_s();
  const int64_t first_step = l.step;
  const int64_t last = o.stop_after > 0 ? std::min(o.stop_after, o.steps) : o.steps;
  while (l.step < last) {
    const double t0 = now_s();
    MemoryTracker::process().reset_peaks();
    const MemoryStats before = MemoryTracker::process().stats();
    ScopedCommCounter counter(mesh.communicators());
    FP_ASSIGN_OR_RETURN(StepStats st, train_step(o, s, data.train, l, be, world));
    const int64_t step = l.step;
    st.seconds = now_s() - t0;
    const MemoryStats after = MemoryTracker::process().stats();
    st.host_bytes_in = after.host_bytes_in - before.host_bytes_in;
    st.host_bytes_out = after.host_bytes_out - before.host_bytes_out;
    step_times.push_back(st.seconds);
    report.losses.push_back(st.loss);
    report.last_loss = st.loss;
    nlohmann::ordered_json line = metrics_line(o, step, st, world, counter.delta().total().bytes_sent);
    const bool eval_now = (o.eval_every > 0 && step % o.eval_every == 0) || step == last;
    if (eval_now) {
      FP_ASSIGN_OR_RETURN(report.val_loss, validate(*l.model, be, data.val, o, s, world));
      line["val_loss"] = report.val_loss;
      if (out.leader) out.progress.note(fmt::format("step {}: validation loss {:.4f}", step, report.val_loss));
    }
    if (out.leader) FP_RETURN_IF_ERROR(out.metrics.append(line.dump()));
    if (out.leader) out.progress.update(step, st.loss, line["tokens_per_s"].get<double>(), now_s() - t_start);
    if ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || (step == last && o.final_checkpoint)) {
      CheckpointState cs{step, static_cast<uint64_t>(step), o.seed, layout, o.config};
      // Experts over dp replicas (Layout::ep): the first replica of each expert-data group
      // writes its experts too.
      Communicator* expert_dp = l.model->expert_data_axis();
      const bool expert_writer = expert_dp != nullptr && expert_dp->rank() == 0;
      CheckpointWrite w{&l.saved_params, &l.adamw->first_moments(), &l.adamw->second_moments(),
                        s.dp_rank == 0 || expert_writer, o.keep_checkpoints, o.checkpoint_hooks, s.dp_rank != 0};
      FP_ASSIGN_OR_RETURN(report.checkpoint, save_checkpoint(ckpt_root, cs, w, world));
      if (out.leader) out.progress.note(fmt::format("step {}: checkpoint {}", step, report.checkpoint));
    }
  }
  if (out.leader) out.progress.finish();
  report.steps_done = l.step - first_step;
  report.final_step = l.step;
  report.tokens_per_second = step_times.empty() ? 0 : static_cast<double>(o.batch * o.seq) / median(step_times);
  return report;
}

}  // namespace foldpar
