// The many-tensor Backend ops (fill_many, sum_squares_many, adamw_update_many) against the
// single-tensor ops, bit for bit, on the CPU backends and the decorators; the meta backend's
// records; and AdamW::step, which now makes one adamw_update_many call, against the
// per-tensor loop it replaced.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/bf16_storage_backend.h"
#include "backend/meta/meta_backend.h"
#include "backend/timed_backend.h"
#include "comm/self_communicator.h"
#include "core/rng.h"
#include "data/corpus.h"
#include "layout/layout.h"
#include "train/optimizer.h"
#include "train/trainer.h"

namespace foldpar {
namespace {

// Sizes with 0 and 1 element, and others on either side of the vector widths.
const std::vector<int64_t> kSizes = {0, 1, 7, 256, 257, 1000, 0, 3};

Tensor random_tensor(int64_t n, DType dtype, uint64_t seed, bool positive = false) {
  Tensor t = Tensor::empty({n}, dtype, MemCategory::kParameters);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(normal_at(seed, 3, i));
    v[static_cast<size_t>(i)] = positive ? x * x : x;
  }
  write_host_f32(v, t);
  return t;
}
Tensor clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), MemCategory::kParameters);
  std::vector<std::byte> bytes(t.nbytes());
  t.copy_to_host(bytes);
  c.copy_from_host(bytes);
  return c;
}
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.numel() != b.numel()) return false;
  std::vector<std::byte> x(a.nbytes()), y(b.nbytes());
  a.copy_to_host(x);
  b.copy_to_host(y);
  return x == y;
}
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

// The backends under test, by name: the reference, the fast CPU backend, the bf16 storage
// decorator over it, and the timing decorator over the fast one.
struct Backends {
  std::unique_ptr<Backend> ref = make_reference_backend(), cpu = make_cpu_backend();
  std::unique_ptr<Backend> bf16 = make_bf16_storage_backend(*cpu);
  TimedBackend timed{*cpu};
  std::vector<std::pair<const char*, Backend*>> all() {
    return {{"reference", ref.get()}, {"cpu", cpu.get()}, {"bf16 storage", bf16.get()}, {"timed", &timed}};
  }
};
// The dtypes a backend takes: f32 everywhere; bf16 through the decorator; f64 on the reference.
std::vector<DType> dtypes_of(const std::string& name) {
  if (name == "reference") return {DType::kF32, DType::kF64};
  if (name == "bf16 storage") return {DType::kF32, DType::kBF16};
  return {DType::kF32};
}

TEST(MultiTensorOps, FillManyEqualsFillPerTensor) {
  Backends b;
  for (auto [name, be] : b.all()) {
    for (DType dt : dtypes_of(name)) {
      std::vector<Tensor> one, many;
      std::vector<Tensor*> ptrs;
      for (size_t i = 0; i < kSizes.size(); ++i) {
        // Mixed dtypes in one call where the backend takes bf16: every other tensor f32.
        const DType t = i % 2 == 0 ? dt : DType::kF32;
        one.push_back(random_tensor(kSizes[i], t, i));
        many.push_back(clone(one.back()));
      }
      for (Tensor& t : many) ptrs.push_back(&t);
      for (Tensor& t : one) be->fill(-2.75, t);
      be->fill_many(-2.75, ptrs);
      for (size_t i = 0; i < one.size(); ++i)
        EXPECT_TRUE(same_bits(one[i], many[i])) << name << " " << dtype_name(dt) << " tensor " << i;
    }
  }
}

TEST(MultiTensorOps, SumSquaresManyEqualsSumSquaresPerTensor) {
  Backends b;
  for (auto [name, be] : b.all()) {
    for (DType dt : dtypes_of(name)) {
      std::vector<Tensor> ts;
      std::vector<const Tensor*> ptrs;
      for (size_t i = 0; i < kSizes.size(); ++i) ts.push_back(random_tensor(kSizes[i], i % 2 == 0 ? dt : DType::kF32, 50 + i));
      for (const Tensor& t : ts) ptrs.push_back(&t);
      std::vector<double> sums(ts.size(), -1.0);
      be->sum_squares_many(ptrs, sums);
      for (size_t i = 0; i < ts.size(); ++i) {
        EXPECT_TRUE(same_bits(sums[i], be->sum_squares(ts[i])))
            << name << " " << dtype_name(dt) << " tensor " << i << ": " << sums[i] << " vs " << be->sum_squares(ts[i]);
        if (kSizes[i] == 0) {
          EXPECT_EQ(sums[i], 0.0);
        }
      }
    }
  }
}

TEST(MultiTensorOps, SumSquaresManyRejectsAResultCountThatDiffers) {
  auto cpu = make_cpu_backend();
  Tensor t = random_tensor(4, DType::kF32, 1);
  std::vector<const Tensor*> ptrs = {&t, &t};
  std::vector<double> sums(1);
  EXPECT_DEATH(cpu->sum_squares_many(ptrs, sums), "2 tensors but 1 results");
}

// AdamW operands of one parameter, grad in `grad_dtype` (bf16 gradients with f32 masters).
struct Param {
  Tensor grad, param, m, v;
  Param(int64_t n, DType grad_dtype, DType dtype, uint64_t seed)
      : grad(random_tensor(n, grad_dtype, seed)), param(random_tensor(n, dtype, seed + 1)),
        m(random_tensor(n, dtype, seed + 2)), v(random_tensor(n, dtype, seed + 3, true)) {}
  Param copy() const {
    Param p = *this;
    p.grad = clone(grad);
    p.param = clone(param);
    p.m = clone(m);
    p.v = clone(v);
    return p;
  }
};

TEST(MultiTensorOps, AdamWUpdateManyEqualsAdamWUpdatePerTensor) {
  Backends b;
  Backend::AdamWStep s;
  s.lr = 3e-3;
  s.weight_decay = 0.1;
  s.grad_scale = 0.5;
  s.step = 4;
  for (auto [name, be] : b.all()) {
    for (DType dt : dtypes_of(name)) {
      std::vector<Param> one, many;
      std::vector<Backend::AdamWTensors> ts;
      for (size_t i = 0; i < kSizes.size(); ++i) {
        // bf16: gradients in bf16, the moments and masters f32 (how the optimizer calls it),
        // and every third parameter all bf16.
        const DType g = dt, p = dt == DType::kBF16 && i % 3 != 0 ? DType::kF32 : dt;
        one.emplace_back(kSizes[i], g, p, 10 * i);
        many.push_back(one.back().copy());
      }
      // Every other tensor also rounds its updated parameter into a copy in the gradient's
      // dtype (the bf16 parameter of an f32 master where dt is bf16): copy() after the
      // single-tensor update.
      std::vector<Tensor> rounded_one, rounded_many;
      for (size_t i = 0; i < many.size(); ++i) {
        rounded_one.push_back(random_tensor(kSizes[i], dt, 900 + i));
        rounded_many.push_back(clone(rounded_one.back()));
      }
      for (size_t i = 0; i < many.size(); ++i)
        ts.push_back({&many[i].grad, &many[i].param, &many[i].m, &many[i].v, i % 2 == 0,
                      i % 2 == 1 ? &rounded_many[i] : nullptr});
      for (size_t i = 0; i < one.size(); ++i) {
        Backend::AdamWStep si = s;
        if (i % 2 != 0) si.weight_decay = 0;
        be->adamw_update(si, one[i].grad, one[i].param, one[i].m, one[i].v);
        if (i % 2 == 1) be->copy(one[i].param, rounded_one[i]);
      }
      be->adamw_update_many(s, ts);
      for (size_t i = 0; i < one.size(); ++i) {
        const std::string what = std::string(name) + " " + std::string(dtype_name(dt)) + " tensor " + std::to_string(i);
        EXPECT_TRUE(same_bits(one[i].param, many[i].param)) << what;
        EXPECT_TRUE(same_bits(one[i].m, many[i].m)) << what;
        EXPECT_TRUE(same_bits(one[i].v, many[i].v)) << what;
        EXPECT_TRUE(same_bits(rounded_one[i], rounded_many[i])) << what << " rounded";
      }
    }
  }
}

TEST(MultiTensorOps, TheTimedDecoratorForwardsEachAsOneCall) {
  Backends b;
  std::vector<Tensor> ts = {random_tensor(5, DType::kF32, 1), random_tensor(0, DType::kF32, 2)};
  std::vector<Tensor*> out = {&ts[0], &ts[1]};
  std::vector<const Tensor*> in = {&ts[0], &ts[1]};
  std::vector<double> sums(2);
  b.timed.fill_many(1.0, out);
  b.timed.sum_squares_many(in, sums);
  EXPECT_EQ(sums[0], 5.0);
  EXPECT_EQ(sums[1], 0.0);
  EXPECT_EQ(b.timed.times().at("fill_many").calls, 1);
  EXPECT_EQ(b.timed.times().at("sum_squares_many").calls, 1);
  EXPECT_EQ(b.timed.times().count("fill"), 0u);
  EXPECT_EQ(b.timed.times().count("sum_squares"), 0u);
}

// The dry run prices each tensor as the single-tensor op it is (the default loop): one
// record per tensor, under the single-tensor op's name, so plans are unchanged.
TEST(MultiTensorOps, TheMetaBackendRecordsOneSingleTensorOpPerTensor) {
  MetaBackend meta;
  std::vector<Param> ps;
  for (int64_t n : {3, 0, 8}) ps.emplace_back(n, DType::kF32, DType::kF32, static_cast<uint64_t>(n));
  std::vector<Backend::AdamWTensors> ts;
  std::vector<Tensor*> grads;
  std::vector<const Tensor*> cgrads;
  for (Param& p : ps) {
    ts.push_back({&p.grad, &p.param, &p.m, &p.v, true});
    grads.push_back(&p.grad);
    cgrads.push_back(&p.grad);
  }
  std::vector<double> sums(ps.size());
  meta.fill_many(0.0, grads);
  meta.sum_squares_many(cgrads, sums);
  meta.adamw_update_many(Backend::AdamWStep{}, ts);
  std::vector<std::string> ops;
  for (const OpRecord& r : meta.records()) ops.emplace_back(r.op);
  const std::vector<std::string> want = {"fill",        "fill",        "fill",        "sum_squares", "sum_squares",
                                         "sum_squares", "adamw_update", "adamw_update", "adamw_update"};
  EXPECT_EQ(ops, want);
  EXPECT_EQ(meta.records()[6].bytes_written, 3 * 3 * 4);
}

// The optimizer step (one adamw_update_many that also rounds the masters into the bf16
// parameters) against the per-tensor loop it replaced, bit for bit, with f32 and bf16 parameters.
TEST(MultiTensorOps, AdamWStepEqualsThePerTensorLoop) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto cpu = make_cpu_backend();
    auto bf16 = make_bf16_storage_backend(*cpu);
    Backend& be = *bf16;
    OptimizerConfig c;
    c.weight_decay = 0.1;
    std::vector<ParamRef> refs;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ParamRef r;
      r.name = "p" + std::to_string(i);
      r.param = random_tensor(kSizes[i], dt, 7 * i);
      r.grad = random_tensor(kSizes[i], dt, 7 * i + 1);
      r.decay = i % 3 != 0;
      refs.push_back(r);
    }
    // The same parameters for the loop (deep copies; gradients shared: read only).
    std::vector<ParamRef> loop_refs = refs;
    for (ParamRef& r : loop_refs) r.param = clone(r.param);
    AdamW opt(refs, c);
    TimedBackend timed(be);
    for (int step = 1; step <= 2; ++step) opt.step(timed, 1e-2, 0.8);
    EXPECT_EQ(timed.times().at("adamw_update_many").calls, 2) << dtype_name(dt);
    EXPECT_EQ(timed.times().count("adamw_update"), 0u) << dtype_name(dt);
    // The masters' rounding into the bf16 parameters rides in that call: no copy per tensor.
    EXPECT_EQ(timed.times().count("copy"), 0u) << dtype_name(dt);

    // The loop as AdamW::step was before adamw_update_many.
    std::vector<Tensor> m, v, master;
    for (const ParamRef& r : loop_refs) {
      m.push_back(Tensor::zeros(r.param.shape(), DType::kF32, MemCategory::kOptimizer));
      v.push_back(Tensor::zeros(r.param.shape(), DType::kF32, MemCategory::kOptimizer));
      master.push_back(r.param.dtype() == DType::kF32 ? Tensor() : r.param.to(DType::kF32, MemCategory::kOptimizer));
    }
    for (int64_t step = 1; step <= 2; ++step) {
      for (size_t i = 0; i < loop_refs.size(); ++i) {
        Backend::AdamWStep s;
        s.lr = 1e-2;
        s.beta1 = c.beta1;
        s.beta2 = c.beta2;
        s.eps = c.eps;
        s.weight_decay = loop_refs[i].decay ? c.weight_decay : 0.0;
        s.grad_scale = 0.8;
        s.step = step;
        Tensor& target = master[i].defined() ? master[i] : loop_refs[i].param;
        be.adamw_update(s, loop_refs[i].grad, target, m[i], v[i]);
      }
      for (size_t i = 0; i < loop_refs.size(); ++i)
        if (master[i].defined()) be.copy(master[i], loop_refs[i].param);
    }
    for (size_t i = 0; i < refs.size(); ++i) {
      EXPECT_TRUE(same_bits(opt.params()[i].param, loop_refs[i].param)) << dtype_name(dt) << " param " << i;
      EXPECT_TRUE(same_bits(opt.first_moments()[i], m[i])) << dtype_name(dt) << " m " << i;
      EXPECT_TRUE(same_bits(opt.second_moments()[i], v[i])) << dtype_name(dt) << " v " << i;
    }
  }
}

// The trainer's steps through a counting decorator: one sum_squares_many (the norm and the
// finite check) and one adamw_update_many per step, no per-tensor sum_squares or
// adamw_update at all (there were one per parameter tensor each: 67 per step for
// configs/llama-1b.json on a tsp layout, 4 per layer + embed, lm_head, final norm).
TEST(MultiTensorOps, TheTrainerMakesOneNormAndOneAdamWCallPerStep) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("foldpar_multi_tensor_" + std::to_string(getpid()));
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "text");
    for (int i = 0; i < 200; ++i) f << "line " << i << ": one launch per optimizer op\n%\n";
  }
  PrepareOptions prep;
  prep.inputs = {(dir / "text").string()};
  prep.out_dir = (dir / "data").string();
  prep.tokenizer = "bytes";
  ASSERT_TRUE(prepare_corpus(prep).ok());
  TrainOptions o;
  o.config.hidden_size = 64;
  o.config.num_attention_heads = 4;
  o.config.num_key_value_heads = 2;
  o.config.intermediate_size = 96;
  o.config.vocab_size = 256;
  o.config.num_hidden_layers = 2;
  o.config.max_position_embeddings = 256;
  o.layout = parse_layout("tsp=1").value();
  o.data_dir = prep.out_dir;
  o.seq = 32;
  o.batch = 2;
  o.steps = 3;
  o.eval_every = 0;
  o.eval_batches = 1;
  o.print_every = 0;
  o.out_dir = (dir / "run").string();
  auto cpu = make_cpu_backend();
  TimedBackend timed(*cpu);
  o.backend = &timed;
  SelfCommunicator world("world", 0);
  Result<TrainReport> r = run_training(o, world);
  std::vector<nlohmann::json> lines;
  {
    std::ifstream metrics(fs::path(o.out_dir) / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) lines.push_back(nlohmann::json::parse(line));
  }
  fs::remove_all(dir);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // The metrics line counts each step's explicit host copies: at least the batch's input and
  // target ids (2 x B x S i32) in, the same every step (nothing else crosses per step).
  ASSERT_EQ(lines.size(), 3u);
  for (const nlohmann::json& l : lines) {
    EXPECT_GE(l["ranks"][0]["host_bytes_in"].get<int64_t>(), 2 * o.batch * o.seq * 4) << l.dump();
    EXPECT_EQ(l["ranks"][0]["host_bytes_in"], lines[1]["ranks"][0]["host_bytes_in"]) << l.dump();
    EXPECT_EQ(l["ranks"][0]["host_bytes_out"], lines[1]["ranks"][0]["host_bytes_out"]) << l.dump();
  }
  EXPECT_EQ(timed.times().at("sum_squares_many").calls, 3);
  EXPECT_EQ(timed.times().at("adamw_update_many").calls, 3);
  EXPECT_EQ(timed.times().count("sum_squares"), 0u);
  EXPECT_EQ(timed.times().count("adamw_update"), 0u);
}

}  // namespace
}  // namespace foldpar
