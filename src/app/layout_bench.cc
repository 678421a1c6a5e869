// The layout benchmark (app/layout_bench.h).
#include "app/layout_bench.h"

#include <sys/resource.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "app/step_bench.h"
#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "backend/timed_backend.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "core/timing.h"
#include "model/flop_count.h"
#include "parallel/make_layout.h"
#include "plan/planner.h"

namespace foldpar {
namespace fs = std::filesystem;
namespace {

int64_t pipeline_micro_batch(const LayoutBenchOptions& o) { return o.micro_batch > 0 ? o.micro_batch : 1; }

struct Sample {
  double seconds = 0, exposed = 0;
  int64_t peak = 0;
  uint64_t sent = 0;
  std::map<std::string, OpTime> ops;  // profile: the timed step's backend ops
  int64_t faults = 0, major_faults = 0;  // rank 0's page faults in the timed step (minor, major)
  std::map<std::string, OpTime> waits;  // profile: "axis kind" -> seconds blocked, calls (rank 0)
  std::vector<int64_t> expert_load;     // MoE models: the timed step's tokens per expert (all layers)
};

struct Faults {
  int64_t minor = 0, major = 0;
};
Faults page_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return {u.ru_minflt, u.ru_majflt};
}

// Rank 0's seconds blocked and calls per (axis, operation kind) over the timed step.
struct WaitSnapshot {
  std::vector<std::pair<const Communicator*, std::array<double, kNumCommOpKinds>>> blocked;
  std::vector<CommStats> stats;
};
WaitSnapshot snapshot_waits(const std::vector<const Communicator*>& comms) {
  WaitSnapshot w;
  for (const Communicator* c : comms) {
    std::array<double, kNumCommOpKinds> b{};
    for (int k = 0; k < kNumCommOpKinds; ++k) b[k] = c->blocked_seconds(static_cast<CommOpKind>(k));
    w.blocked.emplace_back(c, b);
    w.stats.push_back(c->stats());
  }
  return w;
}
std::map<std::string, OpTime> waits_since(const WaitSnapshot& before) {
  std::map<std::string, OpTime> out;
  for (size_t i = 0; i < before.blocked.size(); ++i) {
    const Communicator* c = before.blocked[i].first;
    const CommStats calls = c->stats() - before.stats[i];
    for (int k = 0; k < kNumCommOpKinds; ++k) {
      const auto kind = static_cast<CommOpKind>(k);
      const int64_t n = static_cast<int64_t>(calls.op(kind).calls);
      if (n == 0) continue;
      std::string name = comm_op_name(kind);  // the plan's kinds have no _v forms
      if (name.ends_with("_v")) name.resize(name.size() - 2);
      OpTime& t = out[c->name() + " " + name];
      t.seconds += c->blocked_seconds(kind) - before.blocked[i].second[k];
      t.calls += n;
    }
  }
  return out;
}

// `warmup` steps of a fresh model of `spec`, then one timed step; the peak is the first
// step's, from before the model exists.
Result<Sample> run_once(Communicator& world, const LlamaConfig& c, const Layout& spec, const Batch& global,
                        int64_t S, const LayoutBenchOptions& o) {
  FP_ASSIGN_OR_RETURN(Mesh mesh, Mesh::create(world, spec.mesh()));
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  const int64_t base = mt.stats().current_total;
  mt.reset_peaks();
  Sample s;
  {
    FP_ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> m, make_sharded_model(c, mesh, S, spec));
    m->init_weights(InitOptions{.seed = 1});
    // A pipeline runs the batch as micro-batches through its schedule (pipeline_micro_batch).
    const int64_t micro = spec.pp > 1 ? pipeline_micro_batch(o) : o.batch;
    std::vector<Batch> locals;
    for (int64_t r = 0; r < o.batch; r += micro)
      locals.push_back(m->local_batch(Batch{global.input_ids.narrow(r, r + micro), global.target_ids.narrow(r, r + micro)}));
    auto cpu = make_cpu_backend();
    std::unique_ptr<Backend> bf16 = (spec.dtype == DType::kBF16) ? make_bf16_storage_backend(*cpu) : nullptr;
    Backend* be = bf16 ? bf16.get() : cpu.get();
    auto step = [&](Backend& b) -> Result<StepResult> {
      if (o.forward_only) return m->forward(b, locals.front());
      if (locals.size() == 1) return m->forward_backward(b, locals.front(), 0);
      return m->forward_backward_micro_batches(b, locals, o.batch * S);
    };
    // The peak is the first step's (the plan's figure); later steps of some layouts keep
    // buffers from the first and peak higher (docs/PERFORMANCE.md, Plan against measurement).
    // Every step starts from zeroed gradients, as the trainer's do (ShardedModel::zero_grads,
    // untimed): otherwise sp's second step on accumulates into a fresh scratch copy of the
    // whole gradient (megatron_model.cc), which training never allocates.
    for (int w = 0; w < o.warmup; ++w) {
      if (!o.forward_only) m->zero_grads(*be);
      FP_RETURN_IF_ERROR(step(*be).status());
      if (w == 0) s.peak = mt.stats().peak_total - base;
    }
    std::vector<const Communicator*> comms;
    for (const char* axis : {"tsp", "tp", "sp", "pp"})
      if (mesh.has_axis(axis)) comms.push_back(&mesh.comm(axis));
    if (!o.forward_only) m->zero_grads(*be);
    TimedBackend timed(*be);
    FP_RETURN_IF_ERROR(world.barrier());
    ScopedCommCounter counter(comms);
    const WaitSnapshot waits = snapshot_waits(comms);
    const Faults faults0 = page_faults();
    const double t0 = now_seconds();
    FP_ASSIGN_OR_RETURN(StepResult r, step(o.profile ? static_cast<Backend&>(timed) : *be));
    s.seconds = now_seconds() - t0;
    const Faults faults1 = page_faults();
    s.faults = faults1.minor - faults0.minor;
    s.major_faults = faults1.major - faults0.major;
    s.waits = waits_since(waits);
    s.exposed = r.exposed_comm_seconds;
    s.sent = counter.delta().total().bytes_sent;
    s.ops = timed.times();
    s.expert_load = r.expert_load;
  }
  if (o.warmup == 0) s.peak = mt.stats().peak_total - base;
  FP_RETURN_IF_ERROR(world.all_reduce(&s.seconds, &s.seconds, 1, DType::kF64, ReduceOp::kMax));
  FP_RETURN_IF_ERROR(world.all_reduce(&s.peak, &s.peak, 1, DType::kI64, ReduceOp::kMax));
  // The plan reports the worst rank's bytes (ranks differ on a pipeline's end stages).
  int64_t sent = static_cast<int64_t>(s.sent);
  FP_RETURN_IF_ERROR(world.all_reduce(&sent, &sent, 1, DType::kI64, ReduceOp::kMax));
  s.sent = static_cast<uint64_t>(sent);
  mt.release_cache();
  return s;
}

// The plan's figures for the row (rank 0's coordinates, the bench's step).
Status predict_row(const LayoutBenchOptions& o, const Layout& spec, LayoutBenchRow& row) {
  PlanRequest req;
  req.config = o.config;
  req.devices = spec.ranks();
  req.batch = row.batch;
  req.seq = row.seq;
  req.layouts = {spec};
  req.moe_imbalance = row.moe_imbalance;  // the routing the step measured
  req.bf16 = (spec.dtype == DType::kBF16);
  req.recompute = spec.recompute;
  req.mode = o.forward_only ? PlanMode::kForward : PlanMode::kTrain;
  if (spec.pp > 1 && !o.forward_only) req.micro_batch = pipeline_micro_batch(o);
  // The rows are measured on the CPU backend under the bf16 storage decorator.
  req.bf16_native = false;
  req.matmul_takes_bf16 = make_cpu_backend()->matmul_takes_bf16();
  if (o.hardware != nullptr) {
    req.hardware = *o.hardware;
  } else {
    // A placeholder machine: only memory and traffic are read from the plan.
    req.hardware.name = "none";
    req.hardware.memory_per_device_gb = req.hardware.peak_tflops_f32 = 1;
    req.hardware.intra_node_gb_per_s = req.hardware.inter_node_gb_per_s = 1;
  }
  FP_ASSIGN_OR_RETURN(PlanReport rep, make_plan(req));
  if (rep.layouts.empty()) return invalid_argument("{}: {}", spec.to_string(), rep.not_buildable.front());
  const LayoutPlan& p = rep.layouts.front();
  row.predicted_peak_bytes = p.memory.peak;
  row.predicted_bytes_sent = p.traffic.total().bytes_sent;
  if (o.hardware != nullptr) {
    row.predicted_step_s = p.time.step_s;
    row.predicted_tokens_per_s = p.time.tokens_per_s;
    if (!p.timelines.empty()) {
      const RankTimeline& t = p.timelines.front();  // rank 0 is simulated first
      row.predicted_exposed_s = t.exposed_comm_s;
      for (const TimelineOp& op : t.ops) {
        if (op.kind != TimelineOp::Kind::kCompute) {
          const std::string key = op.communicator + " " + op.op_class;
          auto it = std::find_if(row.waits.begin(), row.waits.end(), [&](const OpProfileRow& x) { return x.op == key; });
          if (it == row.waits.end()) it = row.waits.insert(row.waits.end(), OpProfileRow{.op = key});
          if (op.kind == TimelineOp::Kind::kStall) it->predicted_s += op.end - op.start;
          if (op.kind == TimelineOp::Kind::kTransfer) ++it->predicted_calls;
          continue;
        }
        auto it = std::find_if(row.profile.begin(), row.profile.end(), [&](const OpProfileRow& x) { return x.op == op.name; });
        if (it == row.profile.end()) it = row.profile.insert(row.profile.end(), OpProfileRow{.op = op.name});
        it->predicted_s += op.end - op.start;
        ++it->predicted_calls;
      }
    }
  }
  return Status();
}

Status check_options(const LayoutBenchOptions& o, int ranks) {
  if (o.layouts.empty() || o.seqs.empty()) return invalid_argument("bench: give at least one layout and one --seq");
  if (o.reps < 1) return invalid_argument("bench: --steps ({}) must be at least 1", o.reps);
  if (o.warmup < 0) return invalid_argument("bench: --warmup ({}) must not be negative", o.warmup);
  for (const Layout& l : o.layouts) {
    if (l.ranks() != ranks)
      return invalid_argument("bench: layout {} uses {} ranks, the job has {} (run under mpirun -np {})", l.to_string(),
                              l.ranks(), ranks, l.ranks());
    if (l.dp > 1) return invalid_argument("bench: layout {}: the layout benchmark runs one replica (no dp axis)", l.to_string());
    if (l.pp > 1 && !o.forward_only) {
      const int64_t micro = pipeline_micro_batch(o);
      if (o.batch % micro != 0)
        return invalid_argument("bench: --batch ({}) must be divisible by --micro-batch ({})", o.batch, micro);
      FP_RETURN_IF_ERROR(validate_micro_batches(l, o.batch / micro));
    }
    for (int64_t S : o.seqs) FP_RETURN_IF_ERROR(validate_layout(o.config, l, o.batch, S));
  }
  return Status();
}

}  // namespace

Result<std::vector<LayoutBenchRow>> run_layout_bench(const LayoutBenchOptions& o, Communicator& world) {
  FP_RETURN_IF_ERROR(check_options(o, world.size()));
  const int reps = o.memory_only ? 1 : o.reps;
  std::vector<LayoutBenchRow> rows;
  for (int64_t S : o.seqs) {
    const Batch global = synthetic_batch(o.config, o.batch, S, 1);
    std::map<std::string, std::vector<Sample>> samples;
    for (int rep = 0; rep < reps; ++rep) {
      for (const Layout& spec : o.layouts) {
        FP_ASSIGN_OR_RETURN(Sample s, run_once(world, o.config, spec, global, S, o));
        samples[spec.to_string()].push_back(s);
      }
    }
    for (const Layout& spec : o.layouts) {
      const std::vector<Sample>& v = samples[spec.to_string()];
      LayoutBenchRow row;
      row.layout = spec.to_string();
      row.seq = S;
      row.batch = o.batch;
      std::vector<double> t, e, f, fm;
      for (const Sample& s : v) {
        t.push_back(s.seconds);
        e.push_back(s.exposed);
        f.push_back(static_cast<double>(s.faults));
        fm.push_back(static_cast<double>(s.major_faults));
        row.peak_bytes = std::max(row.peak_bytes, s.peak);
      }
      row.bytes_sent = v.front().sent;
      // MoE: the routing of the timed step (the same weights and batch every repetition), and
      // the plan's equivalent of it for the prediction (moe_imbalance_of_load).
      if (o.config.moe.enabled()) {
        row.expert_load = v.front().expert_load;
        const int64_t expert_ranks = spec.expert_ranks();
        row.moe_imbalance = moe_imbalance_of_load(row.expert_load, expert_ranks, o.config.moe.num_experts_per_tok);
      }
      if (!o.memory_only) {
        row.step_samples_s = t;
        row.step_s = median(t);
        row.exposed_s = median(e);
        row.tokens_per_s = static_cast<double>(o.batch * S) / row.step_s;
        row.page_faults = static_cast<int64_t>(median(f));
        row.major_page_faults = static_cast<int64_t>(median(fm));
      }
      if (o.profile) {
        // Per op (and per axis operation waited on), the median over the repetitions of rank
        // 0's seconds; a repetition without the op counts 0.
        const auto medians = [&](std::map<std::string, OpTime> Sample::*field) {
          std::map<std::string, std::vector<double>> secs;
          std::map<std::string, int64_t> calls;
          for (const Sample& s : v)
            for (const auto& [op, op_time] : s.*field) {
              secs[op].push_back(op_time.seconds);
              calls[op] = op_time.calls;
            }
          std::vector<OpProfileRow> out;
          for (auto& [op, ts] : secs) {
            ts.resize(v.size(), 0.0);
            out.push_back(OpProfileRow{.op = op, .measured_s = median(ts), .measured_calls = calls[op]});
          }
          return out;
        };
        row.profile = medians(&Sample::ops);
        row.waits = medians(&Sample::waits);
      }
      FP_RETURN_IF_ERROR(predict_row(o, spec, row));
      if (!o.profile) {
        row.profile.clear();
        row.waits.clear();
      }
      const auto by_time = [](const OpProfileRow& a, const OpProfileRow& b) {
        return std::max(a.measured_s, a.predicted_s) > std::max(b.measured_s, b.predicted_s);
      };
      std::sort(row.profile.begin(), row.profile.end(),
                [](const OpProfileRow& a, const OpProfileRow& b) { return a.measured_s > b.measured_s; });
      std::sort(row.waits.begin(), row.waits.end(), by_time);
      rows.push_back(row);
    }
  }
  return rows;
}

std::string layout_bench_text(const std::vector<LayoutBenchRow>& rows) {
  size_t w = 22;  // the layout column: as wide as the longest name
  for (const LayoutBenchRow& r : rows) w = std::max(w, r.layout.size());
  std::string s = fmt::format("{:<7} {:<{}} {:>9} {:>11} {:>10} {:>12} {:>12} {:>7} {:>11} {:>11} {:>12}\n", "S",
                              "layout", w, "step s", "tokens/s", "exposed s", "peak MiB", "pred MiB", "ratio",
                              "sent MB", "pred MB", "pred tok/s");
  for (const LayoutBenchRow& r : rows) {
    s += fmt::format("{:<7} {:<{}} {:>9.3f} {:>11.1f} {:>10.3f} {:>12.2f} {:>12.2f} {:>7.3f} {:>11.3f} {:>11.3f} {:>12.1f}\n",
                     r.seq, r.layout, w, r.step_s, r.tokens_per_s, r.exposed_s, r.peak_bytes / 1048576.0,
                     r.predicted_peak_bytes / 1048576.0,
                     static_cast<double>(r.predicted_peak_bytes) / static_cast<double>(std::max<int64_t>(1, r.peak_bytes)),
                     r.bytes_sent / 1e6, r.predicted_bytes_sent / 1e6, r.predicted_tokens_per_s);
  }
  // MoE rows: the measured routing the predictions assumed (the plan has no data of its own).
  for (const LayoutBenchRow& r : rows)
    if (!r.expert_load.empty())
      s += fmt::format("moe routing {} S={}: tokens per expert {}; predicted with --moe-imbalance {:.3f}\n", r.layout,
                       r.seq, fmt::join(r.expert_load, " "), r.moe_imbalance);
  return s + layout_ranking_text(layout_ranking(rows));
}

std::vector<LayoutRanking> layout_ranking(const std::vector<LayoutBenchRow>& rows) {
  std::vector<int64_t> seqs;
  for (const LayoutBenchRow& r : rows)
    if (std::find(seqs.begin(), seqs.end(), r.seq) == seqs.end()) seqs.push_back(r.seq);
  std::vector<LayoutRanking> out;
  for (int64_t S : seqs) {
    std::vector<const LayoutBenchRow*> at;
    for (const LayoutBenchRow& r : rows)
      if (r.seq == S && !r.step_samples_s.empty()) at.push_back(&r);
    if (at.size() < 2) continue;
    LayoutRanking k;
    k.seq = S;
    k.repetitions = static_cast<int>(at.front()->step_samples_s.size());
    for (const LayoutBenchRow* r : at) k.repetitions = std::min(k.repetitions, static_cast<int>(r->step_samples_s.size()));
    const auto order = [&](auto key) {
      std::vector<const LayoutBenchRow*> v = at;
      std::stable_sort(v.begin(), v.end(), [&](const auto* a, const auto* b) { return key(*a) < key(*b); });
      std::vector<std::string> names;
      for (const LayoutBenchRow* r : v) names.push_back(r->layout);
      return names;
    };
    k.measured = order([](const LayoutBenchRow& r) { return r.step_s; });
    const bool predicted = std::all_of(at.begin(), at.end(), [](const auto* r) { return r->predicted_step_s > 0; });
    if (predicted) k.planned = order([](const LayoutBenchRow& r) { return r.predicted_step_s; });
    for (size_t i = 0; i < at.size(); ++i)
      for (size_t j = i + 1; j < at.size(); ++j) {
        ++k.pairs;
        if (k.repetitions < kRankingMinRepetitions) continue;
        int a_first = 0, b_first = 0;
        for (int rep = 0; rep < k.repetitions; ++rep) {
          const double a = at[i]->step_samples_s[rep], b = at[j]->step_samples_s[rep];
          a_first += a < b;
          b_first += b < a;
        }
        if (a_first != k.repetitions && b_first != k.repetitions) continue;
        ++k.decided;
        const LayoutBenchRow *fast = a_first == k.repetitions ? at[i] : at[j], *slow = fast == at[i] ? at[j] : at[i];
        if (!predicted) continue;
        if (fast->predicted_step_s < slow->predicted_step_s) ++k.plan_agrees;
        else k.plan_against.push_back(fmt::format("{} planned ahead of {}", slow->layout, fast->layout));
      }
    out.push_back(std::move(k));
  }
  return out;
}

std::string layout_ranking_text(const std::vector<LayoutRanking>& rankings) {
  std::string s;
  for (const LayoutRanking& k : rankings) {
    s += fmt::format("ranking S={}: measured {}", k.seq, fmt::join(k.measured, " < "));
    if (!k.planned.empty()) s += fmt::format("; planned {}", fmt::join(k.planned, " < "));
    s += "\n";
    if (k.repetitions < kRankingMinRepetitions) {
      s += fmt::format("ranking S={}: too few repetitions ({}) to decide a pair (a sign test needs at least {})\n",
                       k.seq, k.repetitions, kRankingMinRepetitions);
      continue;
    }
    s += fmt::format("ranking S={}: {} of {} pairs decided (one layout faster in all {} repetitions)", k.seq, k.decided,
                     k.pairs, k.repetitions);
    if (!k.planned.empty()) {
      s += fmt::format("; the plan orders {} of them the same", k.plan_agrees);
      if (!k.plan_against.empty()) s += fmt::format(", reversed: {}", fmt::join(k.plan_against, ", "));
    }
    s += "\n";
  }
  return s;
}

std::string layout_bench_profile_text(const std::vector<LayoutBenchRow>& rows) {
  std::string s;
  for (const LayoutBenchRow& r : rows) {
    if (r.profile.empty()) continue;
    s += fmt::format("\nS {} {}: step {:.3f} s (plan {:.3f}), exposed {:.3f} s (plan {:.3f}), {} page faults ({} major)\n",
                     r.seq, r.layout, r.step_s, r.predicted_step_s, r.exposed_s, r.predicted_exposed_s, r.page_faults,
                     r.major_page_faults);
    s += fmt::format("  {:<24} {:>11} {:>11} {:>7} {:>8} {:>8}\n", "op", "measured s", "plan s", "plan/m", "calls",
                     "plan");
    for (const OpProfileRow& p : r.profile)
      s += fmt::format("  {:<24} {:>11.6f} {:>11.6f} {:>7.2f} {:>8} {:>8}\n", p.op, p.measured_s, p.predicted_s,
                       p.measured_s > 0 ? p.predicted_s / p.measured_s : 0.0, p.measured_calls, p.predicted_calls);
    if (r.waits.empty()) continue;
    // Blocked in communication: measured (a blocking call's whole time, a request's wait)
    // against the timeline's stalls; calls against its transfers.
    s += fmt::format("  {:<24} {:>11} {:>11} {:>7} {:>8} {:>8}\n", "blocked in (axis op)", "measured s", "plan s",
                     "plan/m", "calls", "plan");
    for (const OpProfileRow& p : r.waits)
      s += fmt::format("  {:<24} {:>11.6f} {:>11.6f} {:>7.2f} {:>8} {:>8}\n", p.op, p.measured_s, p.predicted_s,
                       p.measured_s > 0 ? p.predicted_s / p.measured_s : 0.0, p.measured_calls, p.predicted_calls);
  }
  return s;
}

Result<std::vector<std::string>> write_layout_bench(const std::vector<LayoutBenchRow>& rows, const std::string& out) {
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return io_error("cannot create '{}': {}", out, ec.message());
  const fs::path dir(out);
  std::ofstream csv(dir / "table.csv");
  csv << "layout,seq,batch,step_s,tokens_per_s,exposed_s,peak_bytes,predicted_peak_bytes,bytes_sent,"
         "predicted_bytes_sent,predicted_step_s,predicted_tokens_per_s\n";
  nlohmann::ordered_json j = nlohmann::json::array();
  for (const LayoutBenchRow& r : rows) {
    csv << r.layout << ',' << r.seq << ',' << r.batch << ',' << r.step_s << ',' << r.tokens_per_s << ','
        << r.exposed_s << ',' << r.peak_bytes << ',' << r.predicted_peak_bytes << ',' << r.bytes_sent << ','
        << r.predicted_bytes_sent << ',' << r.predicted_step_s << ',' << r.predicted_tokens_per_s << '\n';
    j.push_back({{"layout", r.layout}, {"seq", r.seq}, {"batch", r.batch}, {"step_s", r.step_s},
                 {"tokens_per_s", r.tokens_per_s}, {"exposed_s", r.exposed_s}, {"peak_bytes", r.peak_bytes},
                 {"predicted_peak_bytes", r.predicted_peak_bytes}, {"bytes_sent", r.bytes_sent},
                 {"predicted_bytes_sent", r.predicted_bytes_sent}, {"predicted_step_s", r.predicted_step_s},
                 {"predicted_tokens_per_s", r.predicted_tokens_per_s}});
    if (!r.step_samples_s.empty()) j.back()["step_samples_s"] = r.step_samples_s;
    if (!r.expert_load.empty()) {
      j.back()["expert_load"] = r.expert_load;
      j.back()["moe_imbalance"] = r.moe_imbalance;
    }
  }
  csv.close();
  std::ofstream(dir / "table.json") << j.dump(2) << '\n';
  if (!csv) return io_error("cannot write '{}'", (dir / "table.csv").string());
  std::vector<std::string> written{(dir / "table.csv").string(), (dir / "table.json").string()};

  // One data block per layout (gnuplot's `index`), S ascending.
  std::vector<std::string> layouts;
  for (const LayoutBenchRow& r : rows)
    if (std::find(layouts.begin(), layouts.end(), r.layout) == layouts.end()) layouts.push_back(r.layout);
  std::ofstream dat(dir / "rows.dat");
  for (const std::string& l : layouts) {
    dat << "# " << l << '\n';
    for (const LayoutBenchRow& r : rows)
      if (r.layout == l)
        dat << r.seq << ' ' << r.peak_bytes / 1048576.0 << ' ' << r.predicted_peak_bytes / 1048576.0 << ' '
            << r.tokens_per_s << ' ' << r.predicted_tokens_per_s << ' ' << r.step_s << ' ' << r.predicted_step_s
            << '\n';
    dat << "\n\n";
  }
  dat.close();
  const std::string d = (dir / "rows.dat").string();
  std::ofstream gp(dir / "plot.gp");
  gp << "set terminal pngcairo size 900,540 noenhanced\nset grid\nset key top left\nset logscale x 2\n"
     << "set xlabel 'sequence length S (tokens)'\n";
  auto plot = [&](const std::string& png, const std::string& ylabel, const std::string& using_measured,
                  const std::string& using_predicted) {
    gp << "set output '" << (dir / png).string() << "'\nset ylabel '" << ylabel << "'\nplot";
    for (size_t i = 0; i < layouts.size(); ++i) {
      gp << (i ? "," : "") << " '" << d << "' index " << i << " using " << using_measured
         << " with linespoints lw 2 title '" << layouts[i] << " measured'";
      if (!using_predicted.empty())
        gp << ", '" << d << "' index " << i << " using " << using_predicted << " with lines dt 2 title '"
           << layouts[i] << " predicted'";
    }
    gp << '\n';
  };
  plot("memory.png", "tracked peak per rank (MiB)", "1:2", "1:3");
  plot("throughput.png", "tokens/s (training steps)", "1:4", "1:5");
  // Predicted against measured: the peak per rank, and the step time (where a hardware
  // description gave one).
  gp << "unset logscale x\nset logscale xy\nset key top left\nset terminal pngcairo size 1200,540 noenhanced\n"
     << "set output '" << (dir / "predicted.png").string() << "'\nset multiplot layout 1,2\n";
  auto scatter = [&](const std::string& title, const std::string& cols) {
    gp << "set title '" << title << "'\nset xlabel 'measured'\nset ylabel 'predicted'\n"
       << "plot x with lines dt 3 title 'predicted = measured'";
    for (size_t i = 0; i < layouts.size(); ++i)
      gp << ", '" << d << "' index " << i << " using " << cols << " with points pt 7 title '" << layouts[i] << "'";
    gp << '\n';
  };
  scatter("tracked peak per rank (MiB)", "2:3");
  scatter("step time (s)", "6:($7 > 0 ? $7 : NaN)");
  gp << "unset multiplot\n";
  gp.close();
  const int rc = std::system(("gnuplot '" + (dir / "plot.gp").string() + "' 2>&1").c_str());
  if (rc != 0) {
    if (WIFEXITED(rc) && WEXITSTATUS(rc) == 127) return not_found("gnuplot is not installed (scripts/setup.sh installs it)");
    return Status(StatusCode::kInternal, fmt::format("gnuplot failed (status {}) on {}", rc, (dir / "plot.gp").string()));
  }
  for (const char* png : {"memory.png", "throughput.png", "predicted.png"}) written.push_back((dir / png).string());
  return written;
}

}  // namespace foldpar
