// verify on one rank: fast path against reference path; report formatting; the dump for
// the PyTorch oracle.
#include "app/verify.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "app/synthetic.h"
#include "app/verify_common.h"
#include "core/timing.h"
#include "core/tolerance.h"
#include "io/safetensors.h"
#include "tensor/compare.h"

namespace foldpar {
namespace verify_detail {
namespace {

Tensor i64_of(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), DType::kI64, MemCategory::kWorkspace);
  for (int64_t i = 0; i < t.numel(); ++i) out.data<int64_t>()[i] = t.data<int32_t>()[i];
  return out;
}

Status write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return io_error("cannot write {}", path.string());
  return Status();
}

std::vector<std::pair<std::string, Tensor>> named(const LlamaWeights& w) {
  std::vector<std::pair<std::string, Tensor>> list;
  w.for_each([&](const std::string& name, const Tensor& t) { list.emplace_back(name, t); });
  return list;
}

}  // namespace

LlamaWeights verify_weights(const VerifyOptions& o) {
  LlamaWeights w = LlamaWeights::allocate(o.config, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = o.seed, .std = 0.02, .norm_jitter = 0.1}, w);
  return w;
}

Batch verify_batch(const VerifyOptions& o) { return synthetic_batch(o.config, o.batch, o.seq, o.seed + 1); }

void add_gradient_errors(const LlamaWeights& got, const LlamaWeights& want, VerifyReport& r) {
  const auto want_list = named(want);
  size_t i = 0;
  got.for_each([&](const std::string& name, const Tensor& t) {
    r.errors.push_back({name, max_rel_error(t, want_list[i++].second)});
  });
}

void finish_report(VerifyReport& r) {
  r.worst = 0;
  r.worst_name.clear();
  for (const TensorError& e : r.errors) {
    const double err = std::isnan(e.rel_error) ? std::numeric_limits<double>::infinity() : e.rel_error;
    if (err > r.worst || r.worst_name.empty()) {
      r.worst = err;
      r.worst_name = e.name;
    }
  }
  r.passed = r.worst <= r.tolerance;
}

Status write_dump(const VerifyOptions& o, const LlamaWeights& w, const Batch& batch, const LlamaWeights& grads,
                  const Tensor& logits, double loss, int64_t valid_tokens) {
  const std::filesystem::path dir(o.dump_dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return io_error("cannot create dump directory {}: {}", dir.string(), ec.message());
  FP_RETURN_IF_ERROR(write_text(dir / "config.json", o.config.to_json()));
  FP_RETURN_IF_ERROR(write_safetensors((dir / "model.safetensors").string(), named(w), {{"format", "pt"}}));
  FP_RETURN_IF_ERROR(write_safetensors((dir / "grads.safetensors").string(), named(grads), {{"format", "pt"}}));
  FP_RETURN_IF_ERROR(write_safetensors((dir / "batch.safetensors").string(),
                                       {{"input_ids", i64_of(batch.input_ids)}, {"target_ids", i64_of(batch.target_ids)}}));
  FP_RETURN_IF_ERROR(write_safetensors((dir / "logits.safetensors").string(), {{"logits", logits}}));
  nlohmann::ordered_json result;
  result["loss"] = loss;
  result["valid_tokens"] = valid_tokens;
  result["logits_file"] = "logits.safetensors";
  result["seed"] = o.seed;
  if (o.layout) result["layout"] = o.layout->to_string();
  return write_text(dir / "result.json", result.dump(2) + "\n");
}

}  // namespace verify_detail

namespace {

struct PathRun {
  StepResult result;
  LlamaWeights grads;
  double seconds = 0;
};

Result<PathRun> run_path(const VerifyOptions& o, Backend& be, const LlamaWeights& w, const Batch& batch) {
  PathRun run{{}, LlamaWeights::allocate(o.config, DType::kF32, MemCategory::kGradients)};
  run.grads.zero();
  StepOptions step;
  step.recompute = o.recompute;
  step.keep_logits = true;
  const double t0 = now_seconds();
  FP_ASSIGN_OR_RETURN(run.result, model_forward_backward(o.config, be, w, batch, step, run.grads));
  run.seconds = now_seconds() - t0;
  return run;
}

}  // namespace

Result<VerifyReport> run_verify(const VerifyOptions& o) {
  using namespace verify_detail;
  FP_RETURN_IF_ERROR(o.config.validate());
  if (o.batch <= 0 || o.seq <= 0) return invalid_argument("--batch ({}) and --seq ({}) must be positive", o.batch, o.seq);
  const LlamaWeights w = verify_weights(o);
  const Batch batch = verify_batch(o);
  auto fast_be = make_cpu_backend();
  auto ref_be = make_reference_backend();
  FP_ASSIGN_OR_RETURN(PathRun fast, run_path(o, *fast_be, w, batch));
  FP_ASSIGN_OR_RETURN(PathRun ref, run_path(o, *ref_be, w, batch));

  VerifyReport r;
  r.tolerance = o.tolerance > 0 ? o.tolerance : tol::kF32Model;
  r.loss = fast.result.loss;
  r.loss_reference = ref.result.loss;
  r.valid_tokens = fast.result.valid_tokens;
  r.fast_seconds = fast.seconds;
  r.reference_seconds = ref.seconds;
  r.errors.push_back({"loss", std::abs(r.loss - r.loss_reference) / std::max(std::abs(r.loss_reference), 1e-30)});
  r.errors.push_back({"logits", max_rel_error(fast.result.logits, ref.result.logits)});
  add_gradient_errors(fast.grads, ref.grads, r);
  finish_report(r);
  if (!o.dump_dir.empty())
    FP_RETURN_IF_ERROR(write_dump(o, w, batch, fast.grads, fast.result.logits, fast.result.loss,
                                  fast.result.valid_tokens));
  return r;
}

std::string verify_report_text(const VerifyReport& r) {
  std::string s = fmt::format("{:<48} {:>12}\n", "tensor", "rel. error");
  for (const TensorError& e : r.errors) s += fmt::format("{:<48} {:>12.3e}\n", e.name, e.rel_error);
  if (!r.layout.empty()) {
    s += fmt::format("layout {}: single-rank peak {:.2f} MiB\n", r.layout, r.single_rank_peak_bytes / 1048576.0);
    for (size_t i = 0; i < r.peak_bytes.size(); ++i)
      s += fmt::format("  rank {}: tracked peak {:.2f} MiB, sent {:.2f} MiB, received {:.2f} MiB\n", i,
                       r.peak_bytes[i] / 1048576.0, r.bytes_sent[i] / 1048576.0, r.bytes_received[i] / 1048576.0);
  }
  const char* candidate = r.layout.empty() ? "fast path" : "parallel step";
  s += fmt::format("loss {:.8f} (reference {:.8f}) over {} valid tokens; {} {:.3f} s, reference {:.3f} s\n", r.loss,
                   r.loss_reference, r.valid_tokens, candidate, r.fast_seconds, r.reference_seconds);
  s += fmt::format("worst relative error {:.3e} ({}) against tolerance {:.1e}: {}\n", r.worst, r.worst_name,
                   r.tolerance, r.passed ? "PASS" : "FAIL");
  return s;
}

std::string verify_report_json(const VerifyReport& r) {
  nlohmann::ordered_json j;
  j["passed"] = r.passed;
  j["loss"] = r.loss;
  j["loss_reference"] = r.loss_reference;
  j["valid_tokens"] = r.valid_tokens;
  j["tolerance"] = r.tolerance;
  j["worst"] = r.worst;
  j["worst_name"] = r.worst_name;
  j["fast_seconds"] = r.fast_seconds;
  j["reference_seconds"] = r.reference_seconds;
  if (!r.layout.empty()) {
    j["layout"] = r.layout;
    j["single_rank_peak_bytes"] = r.single_rank_peak_bytes;
    j["peak_bytes"] = r.peak_bytes;
    j["bytes_sent"] = r.bytes_sent;
    j["bytes_received"] = r.bytes_received;
  }
  nlohmann::ordered_json errors = nlohmann::ordered_json::object();
  for (const TensorError& e : r.errors) errors[e.name] = e.rel_error;
  j["errors"] = errors;
  return j.dump(2) + "\n";
}

}  // namespace foldpar
