// The Megatron strategy (tp=T, sp=S_, tp=T,sp=S_; parallel/megatron/) against the
// single-rank model, its reference: every rank builds the global weights and batch from one
// seed, computes the single-rank loss, logits and gradients, runs the layout through the
// factory (as verify does) on its tp slices and its tokens, and compares the loss, its own
// logits rows, the assembled logits, every assembled gradient (after one step and after two),
// every ParamRef's weight and gradient slices, and the assembled weights bit for bit. The
// cases of each layout family are those the tp=T, sp=S_ and tp x sp suites held before the
// three became one strategy: GQA and MHA, tied and untied, both K/V exchanges, zigzag and
// contiguous, overlap on and off, recompute, Megatron sequence parallelism, ranks whose
// targets are all ignored; gradient accumulation and loss normalizers; the sequence
// mappings' adjoint identity; the ring attention pieces alone; sizes that do not divide.
// Layouts by world size W: tp=W and sp=W at every W; the 2-D meshes tp=1,sp=1 (W = 1),
// tp=2,sp=1 and tp=1,sp=2 (W = 2), tp=2,sp=2 (W = 4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "comm/mesh.h"
#include "core/rng.h"
#include "core/tolerance.h"
#include "megatron_layouts.h"
#include "mpi_test_main.h"
#include "param_ref_check.h"
#include "parallel/make_layout.h"
#include "parallel/megatron/megatron_model.h"
#include "parallel/ring_attention.h"
#include "parallel/tensor_parallel.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

using Exchange = Layout::KvExchange;

using test::Family;

// The layouts a case runs on: those of the family it was written for.
std::vector<std::string> layouts(Family f) { return test::megatron_layouts(f); }

// sp and the 2-D meshes: n_h 8, n_kv 2 (g = 4: one KV head per rank at T = 2, so a wrong
// K/V head mapping shows) or 8; f and V divide by 2; S = 48 splits in zigzag for S_ <= 4 and
// S/S_ divides by T. tp=T: sizes that divide for T = 1, 2, 4 (GQA g = 2: two KV heads per
// rank at T = 4) and a second config for T = 3; S = 48 divides by every T.
LlamaConfig test_config(Family f, int T, bool tied, bool gqa, int layers) {
  LlamaConfig c;
  if (f == Family::kTp && T == 3) {
    c.hidden_size = 48;  // d = 8
    c.num_attention_heads = 6;
    c.num_key_value_heads = gqa ? 3 : 6;
    c.intermediate_size = 72;
    c.vocab_size = 99;
  } else if (f == Family::kTp) {
    c.hidden_size = 128;  // d = 8
    c.num_attention_heads = 16;
    c.num_key_value_heads = gqa ? 8 : 16;
    c.intermediate_size = 160;
    c.vocab_size = 128;
  } else {
    c.hidden_size = 64;  // d = 8
    c.num_attention_heads = 8;
    c.num_key_value_heads = gqa ? 2 : 8;
    c.intermediate_size = 112;
    c.vocab_size = 96;
  }
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 1024;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// Targets ignored in the reference batch: none; every target of sp rank 0's tokens; or every
// target in the first S/T positions of each sequence (tp rank 0's block with sequence
// parallelism).
enum class Ignore { kNone, kSp0, kFirstTpBlock };

// The Hugging Face attention variants (model/llama_config.h): none, Qwen2's q/k/v biases,
// Llama's attention_bias (q/k/v and o biases), Qwen3's per-head q/k RMSNorm; Llama's
// mlp_bias (gate/up/down biases) alone and with attention_bias.
enum class Variant { kNone, kQwen2, kAttentionBias, kQwen3, kMlpBias, kAllBiases };

struct Case {
  std::string name{};
  Family family = Family::kMesh;
  Exchange exchange = Exchange::kAllGather;
  SeqSplit split = SeqSplit::kZigzag;
  bool overlap = true;
  Recompute recompute = Recompute::kNone;
  bool sequence_parallel = false;
  bool tied = false;
  bool gqa = true;
  int64_t batch = 2;
  int64_t seq = 48;
  int layers = 2;
  Ignore ignore = Ignore::kNone;
  Variant variant = Variant::kNone;
  int64_t head_dim = 0;  // > 0: head_dim independent of hidden_size / heads (qwen3)
  int64_t kv_heads = 0;  // > 0: num_key_value_heads (fewer than tp: KV replicas)
};

void PrintTo(const Case& k, std::ostream* os) { *os << k.name; }

// Weights with std 0.1 so that attention is far from uniform and every path matters.
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

struct Reference {
  LlamaConfig config;
  LlamaWeights weights;
  Batch global;
  StepResult result;
  LlamaWeights grads;
};

// The degree of `axis` in a layout string (1 where the layout lacks it).
int degree_of(const std::string& layout, std::string_view axis) {
  const MeshLayout ml = MeshLayout::parse(layout).value();
  for (const auto& a : ml.axes)
    if (a.name == axis) return a.degree;
  return 1;
}

// The case's model at tp degree T: the family's sizes, its attention variant, head_dim and
// KV heads.
LlamaConfig case_config(const Case& k, int T) {
  LlamaConfig c = test_config(k.family, T, k.tied, k.gqa, k.layers);
  const bool all = k.variant == Variant::kAllBiases;
  c.qkv_bias = k.variant == Variant::kQwen2 || k.variant == Variant::kAttentionBias || all;
  c.o_bias = k.variant == Variant::kAttentionBias || all;
  c.qk_norm = k.variant == Variant::kQwen3;
  c.mlp_bias = k.variant == Variant::kMlpBias || all;
  if (k.head_dim > 0) c.explicit_head_dim = k.head_dim;
  if (k.kv_heads > 0) c.num_key_value_heads = k.kv_heads;
  return c;
}

Reference reference(const Case& k, const std::string& layout) {
  const int T = degree_of(layout, "tp"), P = degree_of(layout, "sp");
  Reference ref;
  ref.config = case_config(k, T);
  const LlamaConfig& c = ref.config;
  ref.weights = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, ref.weights);
  ref.global = synthetic_batch(c, k.batch, k.seq, 11, 0.1);
  std::vector<int32_t> ignored;
  if (k.ignore == Ignore::kSp0) ignored = shard_positions(k.seq, P, 0, k.split);
  if (k.ignore == Ignore::kFirstTpBlock)
    for (int32_t i = 0; i < k.seq / T; ++i) ignored.push_back(i);
  for (int32_t pos : ignored)
    for (int64_t b = 0; b < k.batch; ++b) ref.global.target_ids.data<int32_t>()[b * k.seq + pos] = kIgnoreIndex;
  auto be = make_cpu_backend();
  ref.grads = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref.grads.zero();
  StepOptions so;
  so.keep_logits = true;
  Result<StepResult> r = model_forward_backward(c, *be, ref.weights, ref.global, so, ref.grads);
  FP_CHECK_OK(r.status());
  ref.result = std::move(r.value());
  return ref;
}

struct Built {
  Mesh mesh;
  std::unique_ptr<ShardedModel> model;
};

Built make_layout(const std::string& layout, const Case& k, const LlamaConfig& c) {
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), layout);
  FP_CHECK_OK(mesh.status());
  Built out{std::move(mesh.value()), nullptr};
  Layout o = test::megatron_layout_with(layout, k);
  o.keep_logits = true;
  Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, out.mesh, k.seq, o);
  FP_CHECK_OK(m.status());
  out.model = std::move(m.value());
  out.model->init_weights(kInit);
  return out;
}

// This rank's global positions, computed here independently of the model: the sp shard's,
// or with sequence parallelism the tp rank's contiguous block of them.
std::vector<int32_t> rank_positions(const Case& k, const Mesh& mesh) {
  std::vector<int32_t> pos = shard_positions(k.seq, mesh.degree("sp"), mesh.coord("sp"), k.split);
  if (!k.sequence_parallel) return pos;
  const size_t n = pos.size() / static_cast<size_t>(mesh.degree("tp")), first = n * mesh.coord("tp");
  return {pos.begin() + first, pos.begin() + first + n};
}

// The reference's logits rows at `pos`: [B, |pos|, V].
Tensor reference_rows(const Case& k, const Reference& ref, const std::vector<int32_t>& pos) {
  const int64_t V = ref.config.vocab_size, n = static_cast<int64_t>(pos.size());
  Tensor rows = Tensor::empty({k.batch, n, V}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t b = 0; b < k.batch; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(ref.result.logits.data<float>() + (b * k.seq + pos[i]) * V, V,
                  rows.data<float>() + (b * n + i) * V);
  return rows;
}

// Every assembled gradient of `model` against `scale` times the reference's.
void expect_grads(ShardedModel& model, const Reference& ref, double scale, const std::string& what) {
  const int rank = test::mpi().world().rank();
  LlamaWeights assembled = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<Tensor> want;
  ref.grads.for_each([&](const std::string&, const Tensor& t) {
    Tensor s = t.clone(MemCategory::kWorkspace);
    for (int64_t i = 0; i < s.numel(); ++i) s.data<float>()[i] *= static_cast<float>(scale);
    want.push_back(s);
  });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_LT(i, want.size());
    const Tensor& w = want[i++];
    EXPECT_LE(max_rel_error(t, w), tol::kF32Parallel)
        << what << ": " << name << " on rank " << rank << "\n" << describe_mismatches(t, w, tol::kF32Parallel);
  });
  EXPECT_EQ(i, want.size());
}

// Every ParamRef: its parameter and gradient slices equal the reference's blocks (so the
// norm gains' gradients are complete on every rank, not only where assemble reads them),
// and the counted elements over the whole world add up to the model's parameter count.
void expect_parameters(ShardedModel& model, const Reference& ref) {
  const std::vector<ParamRef> params = model.parameters();
  for (const ParamRef& p : params) EXPECT_EQ(p.decay, !p.name.ends_with("norm") && !p.name.ends_with("bias")) << p.name;
  int64_t counted = test::expect_param_refs(params, ref.weights, ref.grads, "one step");
  ASSERT_TRUE(test::mpi().world().all_reduce(&counted, &counted, 1, DType::kI64, ReduceOp::kSum).ok());
  EXPECT_EQ(counted, ref.config.parameter_count());
}

void check_parity(const std::string& layout, const Case& k) {
  SCOPED_TRACE(layout + " " + k.name);
  const int rank = test::mpi().world().rank();
  const Reference ref = reference(k, layout);
  Built l = make_layout(layout, k, ref.config);
  ShardedModel& model = *l.model;
  EXPECT_EQ(model.layout(), layout);
  const Batch local = model.local_batch(ref.global);
  const std::vector<int32_t> pos = rank_positions(k, l.mesh);
  ASSERT_EQ(local.seq(), static_cast<int64_t>(pos.size()));
  auto be = make_cpu_backend();
  Result<StepResult> got = model.forward_backward(*be, local, 0);
  ASSERT_TRUE(got.ok()) << got.status().to_string();

  // f32; only the order of summation differs (partial outputs summed over tp, the
  // log-sum-exp over vocabulary shards, gradients over sp): kF32Parallel.
  EXPECT_EQ(got->valid_tokens, ref.result.valid_tokens);
  EXPECT_NEAR(got->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
  EXPECT_NEAR(got->loss_sum, ref.result.loss_sum, tol::kF32Parallel * ref.result.loss_sum);
  EXPECT_TRUE(std::isfinite(got->exposed_comm_seconds) && got->exposed_comm_seconds >= 0);
  const Tensor rows = reference_rows(k, ref, pos);
  EXPECT_LE(max_rel_error(got->logits, rows), tol::kF32Parallel)
      << "logits of rank " << rank << "\n" << describe_mismatches(got->logits, rows, tol::kF32Parallel);
  Tensor global_logits = Tensor::empty(ref.result.logits.shape(), DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model.assemble_logits(got->logits, global_logits).ok());
  EXPECT_LE(max_rel_error(global_logits, ref.result.logits), tol::kF32Parallel) << "assembled logits";
  expect_grads(model, ref, 1.0, "one step");
  expect_parameters(model, ref);

  // Forward alone: the same loss and logits.
  Result<StepResult> fwd = model.forward(*be, local);
  ASSERT_TRUE(fwd.ok()) << fwd.status().to_string();
  EXPECT_EQ(fwd->valid_tokens, ref.result.valid_tokens);
  EXPECT_NEAR(fwd->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
  EXPECT_LE(max_rel_error(fwd->logits, rows), tol::kF32Parallel) << "forward logits of rank " << rank;

  // Weights: the single-rank model's, bit for bit.
  LlamaWeights got_w = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model.assemble_weights(got_w).ok());
  std::vector<Tensor> want_w;
  ref.weights.for_each([&](const std::string&, const Tensor& t) { want_w.push_back(t); });
  size_t i = 0;
  got_w.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, want_w[i++]), 0.0) << name; });

  // Gradients accumulate: a second step doubles them.
  ASSERT_TRUE(model.forward_backward(*be, local, 0).ok());
  expect_grads(model, ref, 2.0, "two steps");
}

class MegatronParity : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (layouts(GetParam().family).empty()) GTEST_SKIP() << "the 2-D meshes are listed for 1, 2 and 4 ranks";
  }
};

TEST_P(MegatronParity, LossLogitsEveryGradientAndParameterMatchTheSingleRankModel) {
  for (const std::string& layout : layouts(GetParam().family)) check_parity(layout, GetParam());
}

Case named(Case k, std::string name) {
  k.name = std::move(name);
  return k;
}

// tp=T: GQA and MHA, tied and untied, with and without sequence parallelism; recompute, one
// layer, overlap off, tp rank 0's rows ignored.
void add_tp_cases(std::vector<Case>& out) {
  for (bool sp : {false, true})
    for (bool gqa : {true, false})
      for (bool tied : {false, true})
        out.push_back(Case{.name = std::string("tp_") + (sp ? "seqpar" : "plain") + (gqa ? "_gqa" : "_mha") +
                                   (tied ? "_tied" : "_untied"),
                           .family = Family::kTp,
                           .sequence_parallel = sp,
                           .tied = tied,
                           .gqa = gqa});
  for (bool sp : {false, true}) {
    const Case base{.family = Family::kTp, .sequence_parallel = sp};
    const std::string p = sp ? "tp_seqpar" : "tp_plain";
    Case k = base;
    k.recompute = Recompute::kBlock;
    out.push_back(named(k, p + "_recompute"));
    k.tied = true;
    k.gqa = false;
    out.push_back(named(k, p + "_recompute_tied_mha"));
    k = base;
    k.layers = 1;
    out.push_back(named(k, p + "_one_layer"));
    k = base;
    k.overlap = false;
    out.push_back(named(k, p + "_no_overlap"));
    k.recompute = Recompute::kBlock;
    out.push_back(named(k, p + "_no_overlap_recompute"));
    k = base;
    k.ignore = Ignore::kFirstTpBlock;
    out.push_back(named(k, p + "_rank0_rows_ignored"));
    // Fewer KV heads than tp ranks (issue 21): every rank a replica of the one KV head its
    // query heads read, its wk/wv gradient summed over the group.
    // (Sequence parallelism with replicas: the mesh case mesh_ring_seqpar_one_kv_head.)
    // With Qwen2's biases: the k/v bias gradient partials are summed over tp with the others.
    if (!sp) {
      k = base;
      k.kv_heads = 1;
      k.variant = Variant::kQwen2;
      k.tied = true;
      out.push_back(named(k, p + "_one_kv_head_qwen2_tied"));
    }
    // The attention variants: q/k/v biases sharded by heads with the column-parallel weight,
    // the o bias once after the row-parallel sum, the q/k norms per local head; the bias
    // and norm gradients summed over tp (every ParamRef checked on every rank).
    k = base;
    k.variant = Variant::kQwen2;
    out.push_back(named(k, p + "_qwen2_biases"));
    k = base;
    k.variant = Variant::kAttentionBias;
    k.tied = true;
    out.push_back(named(k, p + "_attention_bias_tied"));
    k = base;
    k.variant = Variant::kQwen3;
    k.recompute = sp ? Recompute::kBlock : Recompute::kNone;
    k.head_dim = sp ? 0 : 12;
    out.push_back(named(k, p + (sp ? "_qwen3_qk_norms_recompute" : "_qwen3_qk_norms_head_dim_12")));
    // Llama's mlp_bias: gate/up bias slices with this rank's columns, the down bias once
    // after the row-parallel sum, its gradient from dy (no tp sum), the others summed over tp.
    k = base;
    k.variant = sp ? Variant::kAllBiases : Variant::kMlpBias;
    k.tied = sp;
    out.push_back(named(k, p + (sp ? "_all_biases_tied" : "_mlp_bias")));
  }
}

// sp=S_, each K/V exchange: zigzag and contiguous, tied, MHA, overlap off, recompute, one
// layer and one sequence, sp rank 0's targets ignored.
void add_sp_cases(std::vector<Case>& out) {
  for (Exchange x : {Exchange::kAllGather, Exchange::kRing}) {
    const Case base{.family = Family::kSp, .exchange = x};
    const std::string p = x == Exchange::kRing ? "sp_ring" : "sp_allgather";
    Case k = base;
    out.push_back(named(k, p + "_zigzag_gqa_untied"));
    k.split = SeqSplit::kContiguous;
    out.push_back(named(k, p + "_contiguous"));
    k = base;
    k.tied = true;
    out.push_back(named(k, p + "_tied"));
    k = base;
    k.gqa = false;
    out.push_back(named(k, p + "_mha"));
    k = base;
    k.overlap = false;
    out.push_back(named(k, p + "_no_overlap"));
    k.split = SeqSplit::kContiguous;
    out.push_back(named(k, p + "_no_overlap_contiguous"));
    k = base;
    k.recompute = Recompute::kBlock;
    out.push_back(named(k, p + "_recompute"));
    k.split = SeqSplit::kContiguous;
    k.overlap = false;
    k.tied = true;
    k.gqa = false;
    out.push_back(named(k, p + "_recompute_contiguous_no_overlap_tied_mha"));
    k = base;
    k.layers = 1;
    k.batch = 1;
    k.seq = 24;
    out.push_back(named(k, p + "_one_layer_one_sequence"));
    k = base;
    k.ignore = Ignore::kSp0;
    out.push_back(named(k, p + "_rank0_targets_ignored"));
    // The attention variants: their gradients summed over sp with the rest.
    k = base;
    k.variant = x == Exchange::kRing ? Variant::kQwen3 : Variant::kAttentionBias;
    out.push_back(named(k, p + (x == Exchange::kRing ? "_qwen3_qk_norms" : "_attention_bias")));
    k = base;
    k.variant = Variant::kMlpBias;
    out.push_back(named(k, p + "_mlp_bias"));
  }
}

// tp=T,sp=S_: both exchanges, both splits, tied and MHA, recompute, sequence parallelism
// inside the tp group, one layer and one sequence, sp rank 0's targets ignored (at S_ = 1
// every target: loss 0 and zero gradients, not NaN).
void add_mesh_cases(std::vector<Case>& out) {
  const Exchange ring = Exchange::kRing;
  const SeqSplit contiguous = SeqSplit::kContiguous;
  const Recompute block = Recompute::kBlock;
  const Family m = Family::kMesh;
  out.push_back(Case{.name = "mesh_allgather_zigzag_gqa", .family = m});
  // KV replicas under tp with K/V exchanged over sp: n_kv = 1 at tp = 2.
  out.push_back(Case{.name = "mesh_ring_seqpar_one_kv_head", .family = m, .exchange = ring, .sequence_parallel = true,
                     .kv_heads = 1});
  out.push_back(Case{.name = "mesh_ring_zigzag_gqa", .family = m, .exchange = ring});
  out.push_back(Case{.name = "mesh_allgather_contiguous", .family = m, .split = contiguous});
  out.push_back(Case{.name = "mesh_ring_contiguous_no_overlap", .family = m, .exchange = ring, .split = contiguous,
                     .overlap = false});
  out.push_back(Case{.name = "mesh_tied_mha", .family = m, .tied = true, .gqa = false});
  out.push_back(Case{.name = "mesh_ring_tied", .family = m, .exchange = ring, .tied = true});
  out.push_back(Case{.name = "mesh_no_overlap_mha", .family = m, .overlap = false, .gqa = false});
  out.push_back(Case{.name = "mesh_recompute", .family = m, .recompute = block});
  out.push_back(Case{.name = "mesh_ring_contiguous_no_overlap_recompute_tied_mha",
                     .family = m,
                     .exchange = ring,
                     .split = contiguous,
                     .overlap = false,
                     .recompute = block,
                     .tied = true,
                     .gqa = false});
  out.push_back(Case{.name = "mesh_seqpar", .family = m, .sequence_parallel = true});
  out.push_back(Case{.name = "mesh_seqpar_ring_recompute",
                     .family = m,
                     .exchange = ring,
                     .recompute = block,
                     .sequence_parallel = true});
  out.push_back(Case{.name = "mesh_seqpar_contiguous_no_overlap_recompute_tied_mha",
                     .family = m,
                     .split = contiguous,
                     .overlap = false,
                     .recompute = block,
                     .sequence_parallel = true,
                     .tied = true,
                     .gqa = false});
  out.push_back(Case{.name = "mesh_one_layer_one_sequence", .family = m, .batch = 1, .seq = 24, .layers = 1});
  out.push_back(Case{.name = "mesh_sp0_targets_ignored", .family = m, .ignore = Ignore::kSp0});
  out.push_back(Case{.name = "mesh_seqpar_attention_bias",
                     .family = m,
                     .sequence_parallel = true,
                     .variant = Variant::kAttentionBias});
  out.push_back(Case{.name = "mesh_seqpar_ring_all_biases",
                     .family = m,
                     .exchange = ring,
                     .sequence_parallel = true,
                     .variant = Variant::kAllBiases});
  out.push_back(Case{.name = "mesh_ring_qwen3_qk_norms_head_dim_12",
                     .family = m,
                     .exchange = ring,
                     .variant = Variant::kQwen3,
                     .head_dim = 12});
  out.push_back(Case{.name = "mesh_seqpar_ring_sp0_targets_ignored",
                     .family = m,
                     .exchange = ring,
                     .sequence_parallel = true,
                     .ignore = Ignore::kSp0});
}

std::vector<Case> cases() {
  std::vector<Case> out;
  add_tp_cases(out);
  add_sp_cases(out);
  add_mesh_cases(out);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, MegatronParity, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// ---- bf16 storage (:bf16) against the single-rank model in bf16 ----
//
// Both sides store weights and activations in bf16 and compute through the bf16 storage
// decorator (f32 arithmetic, every bf16 result rounded once; statistics and gradients f32),
// as `train --bf16` runs them; the reference is the single-rank model with the same bf16
// weights, and the single-rank model in f32 beside it. The layout rounds where the
// single-rank model does not: each row-parallel partial is rounded to bf16 before the sum
// over tp and the residual add (the single-rank GEMM adds into x and rounds once), and in
// backward each column-parallel dX partial and each sp rank's dK/dV partial before their
// sums. So the two bf16 runs are two different roundings of the same f32 computation, each
// as far from exact arithmetic as bf16 storage puts any run.
//   bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 relative, one
//   ulp is 2^-8 (kBf16Ulp). A step chains about 40 dependent rounded results (2 blocks x
//   ~10 sub-steps, forward and back); as a random walk that is sqrt(40) x 2^-9 ~ 1.2e-2
//   typical and about three times that at the worst element of a tensor (the comparison is
//   normwise: the largest error over the largest reference element, tensor/compare.h).
//   gradients, logits: 16 ulp = 6.25e-2, against the single-rank bf16 model and against f32
//         (tests/unit/bf16_test.cc holds the single-rank bf16 model to f32 at the same 6e-2).
//         Observed: 0.5-2.6e-2 against bf16, 0.8-3.7e-2 against f32 (the single-rank bf16
//         model itself is up to 3.4e-2 from f32). A lost partial sum shows errors of order
//         1 (tried: the tp all_reduce of the row partials skipped gives 1.0-1.2). This
//         bound does not see a lone statistic rounded to bf16 (tried: attention's lse in
//         bf16 moves the gradients by about 1e-2, within bf16's own noise); the f32
//         statistics rest on the step's stat() allocations, not on this test.
//   loss: a mean over B*S = 96 tokens' log-sum-exps, each a few ulp off at most, averages
//         below one ulp: 1 ulp = 3.9e-3 relative. Observed at most 4.5e-4.
constexpr double kBf16Ulp = 1.0 / 256;  // 2^-8: the spacing of bf16 values relative to their size
constexpr double kBf16LossTol = 1 * kBf16Ulp;
constexpr double kBf16TensorTol = 16 * kBf16Ulp;
//   q/k norm gains (qwen3) against f32 only: their gradient is a sum over every token and
//         head of terms of order 1 that cancel to about 2e-2, so each term's rounding counts
//         against a small result: the single-rank bf16 model alone is 4.9e-2 from f32 (sp=1),
//         and a layout within 16 ulp of it (observed 4.6e-2) lands up to 6.5e-2 from f32
//         (sp=4). 32 ulp = 0.125 for these two gains against f32; against the bf16 model the
//         16-ulp rule stands.
//   k/q/v biases against f32 only, for the same reason: a bias gradient is dk (dq, dv)
//         summed over every token, terms that largely cancel (the k bias's to 3.5e-3 here),
//         so the layout's bf16 rounding of each term lands up to 6.6e-2 from f32 (tp=3 with
//         one KV head) while it stays within 16 ulp of the bf16 model.
constexpr double kBf16QkNormF32Tol = 32 * kBf16Ulp;

struct Bf16Case {
  std::string name{};
  Family family = Family::kMesh;
  Exchange exchange = Exchange::kAllGather;
  bool sequence_parallel = false;
  bool tied = false;
  Recompute recompute = Recompute::kNone;
  Variant variant = Variant::kNone;
  int64_t kv_heads = 0;  // > 0: num_key_value_heads (fewer than tp: KV replicas)
};

void PrintTo(const Bf16Case& k, std::ostream* os) { *os << k.name; }

class MegatronBf16Parity : public ::testing::TestWithParam<Bf16Case> {
 protected:
  void SetUp() override {
    if (layouts(GetParam().family).empty()) GTEST_SKIP() << "the 2-D meshes are listed for 1, 2 and 4 ranks";
  }
};

void check_bf16_parity(const std::string& layout, const Bf16Case& b) {
  SCOPED_TRACE(layout + " " + b.name);
  const int rank = test::mpi().world().rank();
  const Case k{.family = b.family,
               .exchange = b.exchange,
               .recompute = b.recompute,
               .sequence_parallel = b.sequence_parallel,
               .tied = b.tied,
               .variant = b.variant,
               .kv_heads = b.kv_heads};
  const int T = degree_of(layout, "tp");
  const LlamaConfig c = case_config(k, T);
  const Batch global = synthetic_batch(c, k.batch, k.seq, 11, 0.1);
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);

  // The single-rank model in bf16, and in f32.
  StepOptions so;
  so.keep_logits = true;
  LlamaWeights w = LlamaWeights::allocate(c, DType::kBF16, MemCategory::kParameters);
  init_weights(kInit, w);
  LlamaWeights want_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  want_g.zero();
  Result<StepResult> want = model_forward_backward(c, *bf, w, global, so, want_g);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  LlamaWeights w32 = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w32);
  LlamaWeights f32_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  f32_g.zero();
  Result<StepResult> f32 = model_forward_backward(c, *cpu, w32, global, so, f32_g);
  ASSERT_TRUE(f32.ok()) << f32.status().to_string();

  // The layout in bf16.
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), layout);
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Layout o = test::megatron_layout_with(layout, k);
  o.dtype = DType::kBF16;
  o.keep_logits = true;
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, k.seq, o);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ShardedModel& model = **made;
  model.init_weights(kInit);
  // bf16 storage: the parameters are bf16, their gradients f32.
  for (const ParamRef& p : model.parameters()) {
    EXPECT_EQ(p.param.dtype(), DType::kBF16) << p.name;
    EXPECT_EQ(p.grad.dtype(), DType::kF32) << p.name;
  }
  // The same bf16 weights as the single-rank model's, bit for bit.
  LlamaWeights got_w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model.assemble_weights(got_w).ok());
  std::vector<Tensor> want_w;
  w.for_each([&](const std::string&, const Tensor& t) { want_w.push_back(t); });
  size_t i = 0;
  got_w.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, want_w[i++]), 0.0) << name; });

  const Batch local = model.local_batch(global);
  Result<StepResult> got = model.forward_backward(*bf, local, 0);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->valid_tokens, want->valid_tokens);
  EXPECT_NEAR(got->loss, want->loss, kBf16LossTol * want->loss) << "against the single-rank bf16 model";
  EXPECT_NEAR(got->loss, f32->loss, kBf16LossTol * f32->loss) << "against the single-rank f32 model";
  Tensor global_logits = Tensor::empty(want->logits.shape(), DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model.assemble_logits(got->logits, global_logits).ok());
  EXPECT_LE(max_rel_error(global_logits, want->logits), kBf16TensorTol)
      << "assembled logits on rank " << rank << "\n"
      << describe_mismatches(global_logits, want->logits, kBf16TensorTol);
  EXPECT_LE(max_rel_error(global_logits, f32->logits), kBf16TensorTol) << "assembled logits against f32";
  LlamaWeights got_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(got_g).ok());
  std::vector<Tensor> want_gs, f32_gs;
  want_g.for_each([&](const std::string&, const Tensor& t) { want_gs.push_back(t); });
  f32_g.for_each([&](const std::string&, const Tensor& t) { f32_gs.push_back(t); });
  i = 0;
  double worst = 0, worst_f32 = 0;
  got_g.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_LT(i, want_gs.size());
    const double e = max_rel_error(t, want_gs[i]), e32 = max_rel_error(t, f32_gs[i]);
    worst = std::max(worst, e);
    worst_f32 = std::max(worst_f32, e32);
    EXPECT_LE(e, kBf16TensorTol) << name << " on rank " << rank << " against bf16\n"
                                 << describe_mismatches(t, want_gs[i], kBf16TensorTol);
    const bool qk_norm = name.ends_with("self_attn.q_norm.weight") || name.ends_with("self_attn.k_norm.weight") ||
                         name.ends_with("_proj.bias");
    const double tol32 = qk_norm ? kBf16QkNormF32Tol : kBf16TensorTol;
    EXPECT_LE(e32, tol32) << name << " on rank " << rank << " against f32\n" << describe_mismatches(t, f32_gs[i], tol32);
    ++i;
  });
  EXPECT_EQ(i, want_gs.size());
  // Forward alone: the same loss.
  Result<StepResult> fwd = model.forward(*bf, local);
  ASSERT_TRUE(fwd.ok()) << fwd.status().to_string();
  EXPECT_NEAR(fwd->loss, want->loss, kBf16LossTol * want->loss);
  if (rank == 0)
    std::printf("%s %s: loss %.6f (bf16 %.6f, f32 %.6f); worst gradient error %.2e against bf16, %.2e against f32\n",
                layout.c_str(), b.name.c_str(), got->loss, want->loss, f32->loss, worst, worst_f32);
}

TEST_P(MegatronBf16Parity, LossLogitsAndGradientsMatchTheSingleRankBf16Model) {
  for (const std::string& layout : layouts(GetParam().family)) check_bf16_parity(layout, GetParam());
}

std::vector<Bf16Case> bf16_cases() {
  return {Bf16Case{.name = "tp_bf16_plain", .family = Family::kTp},
          Bf16Case{.name = "tp_bf16_seqpar_tied", .family = Family::kTp, .sequence_parallel = true, .tied = true},
          Bf16Case{.name = "tp_bf16_seqpar_recompute",
                   .family = Family::kTp,
                   .sequence_parallel = true,
                   .recompute = Recompute::kBlock},
          Bf16Case{.name = "sp_bf16_allgather", .family = Family::kSp},
          Bf16Case{.name = "sp_bf16_allgather_tied_recompute",
                   .family = Family::kSp,
                   .tied = true,
                   .recompute = Recompute::kBlock},
          Bf16Case{.name = "sp_bf16_ring", .family = Family::kSp, .exchange = Exchange::kRing},
          Bf16Case{.name = "mesh_bf16_plain", .family = Family::kMesh},
          Bf16Case{.name = "mesh_bf16_seqpar", .family = Family::kMesh, .sequence_parallel = true},
          Bf16Case{.name = "mesh_bf16_ring_seqpar_recompute",
                   .family = Family::kMesh,
                   .exchange = Exchange::kRing,
                   .sequence_parallel = true,
                   .recompute = Recompute::kBlock},
          // The attention variants (their bf16 biases and gains replicated, gradients f32) and
          // KV replicas (one KV head: a replica on every tp rank).
          Bf16Case{.name = "tp_bf16_qwen2", .family = Family::kTp, .variant = Variant::kQwen2},
          Bf16Case{.name = "tp_bf16_seqpar_attention_bias_one_kv_head",
                   .family = Family::kTp,
                   .sequence_parallel = true,
                   .variant = Variant::kAttentionBias,
                   .kv_heads = 1},
          Bf16Case{.name = "sp_bf16_qwen3", .family = Family::kSp, .variant = Variant::kQwen3},
          Bf16Case{.name = "sp_bf16_ring_qwen2", .family = Family::kSp, .exchange = Exchange::kRing,
                   .variant = Variant::kQwen2},
          Bf16Case{.name = "mesh_bf16_seqpar_attention_bias",
                   .family = Family::kMesh,
                   .sequence_parallel = true,
                   .variant = Variant::kAttentionBias},
          Bf16Case{.name = "mesh_bf16_qwen3_one_kv_head", .family = Family::kMesh, .variant = Variant::kQwen3,
                   .kv_heads = 1},
          // Llama's mlp_bias (bf16 biases, replicated; gradients f32).
          Bf16Case{.name = "tp_bf16_seqpar_all_biases", .family = Family::kTp, .sequence_parallel = true,
                   .variant = Variant::kAllBiases},
          Bf16Case{.name = "mesh_bf16_mlp_bias", .family = Family::kMesh, .variant = Variant::kMlpBias}};
}

INSTANTIATE_TEST_SUITE_P(Bf16, MegatronBf16Parity, ::testing::ValuesIn(bf16_cases()),
                         [](const ::testing::TestParamInfo<Bf16Case>& i) { return i.param.name; });

// Two steps without zeroing: only each step's partial is summed over sp, so the gradients
// are twice one step's (summing everything again would give 1 + S_). Then a loss normalizer:
// the gradient of loss_sum / N is the reference's (of loss_sum / valid) times valid / N, and
// two micro-batches each normalized by the pair's count give the mean's gradient. On every
// family's layouts; sequence parallelism on tp=T and the meshes.
TEST(MegatronGradients, AccumulateAndHonourTheLossNormalizer) {
  std::vector<Case> variants;
  for (Family f : {Family::kTp, Family::kSp, Family::kMesh})
    for (bool ring : {false, true})
      variants.push_back(Case{.name = ring ? "ring" : "allgather",
                              .family = f,
                              .exchange = ring ? Exchange::kRing : Exchange::kAllGather,
                              .sequence_parallel = ring && f != Family::kSp});
  for (const Case& k : variants)
    for (const std::string& layout : layouts(k.family)) {
      SCOPED_TRACE(layout + " " + k.name + (k.sequence_parallel ? " seqpar" : ""));
      const Reference ref = reference(k, layout);
      Built l = make_layout(layout, k, ref.config);
      ShardedModel& m = *l.model;
      const Batch local = m.local_batch(ref.global);
      auto be = make_cpu_backend();
      ASSERT_TRUE(m.forward_backward(*be, local, 0).ok());
      ASSERT_TRUE(m.forward_backward(*be, local, 0).ok());
      expect_grads(m, ref, 2.0, "two steps");
      ASSERT_TRUE(m.forward_backward(*be, local, 0).ok());
      expect_grads(m, ref, 3.0, "three steps");
      m.zero_grads(*be);
      ASSERT_TRUE(m.forward_backward(*be, local, 0).ok());
      expect_grads(m, ref, 1.0, "after zero_grads");

      const int64_t valid = ref.result.valid_tokens, N = 3 * valid + 5;
      m.zero_grads(*be);
      Result<StepResult> r = m.forward_backward(*be, local, N);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_NEAR(r->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss) << "the loss is not rescaled";
      EXPECT_EQ(r->valid_tokens, valid);
      expect_grads(m, ref, static_cast<double>(valid) / static_cast<double>(N), "loss_sum / N");

      m.zero_grads(*be);
      ASSERT_TRUE(m.forward_backward(*be, local, 2 * valid).ok());
      ASSERT_TRUE(m.forward_backward(*be, local, 2 * valid).ok());
      expect_grads(m, ref, 1.0, "two micro-batches normalized by their joint count");
    }
}

// sum over ranks <all_gather_seq(x), y> == sum over ranks <x, reduce_scatter_seq(y)>, exact
// on integer values; and the gathered rows land in their places (rank r's block of every
// batch entry at [r*n, (r+1)*n)). B = 3 exercises the rank-major staging.
TEST(TpMappings, SequenceGatherAndReduceScatterAreAdjoint) {
  Communicator& world = test::mpi().world();
  const int T = world.size(), t = world.rank();
  const int64_t B = 3, n = 2, c = 5;
  auto be = make_cpu_backend();
  for (bool overlap : {true, false}) {
    TpComm tp(world, *be, overlap);
    Tensor x = Tensor::empty({B, n, c}, DType::kF32, MemCategory::kWorkspace);
    Tensor y = Tensor::empty({B, T * n, c}, DType::kF32, MemCategory::kWorkspace);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>((t * 7 + i * 3) % 11) - 5;
    for (int64_t i = 0; i < y.numel(); ++i) y.data<float>()[i] = static_cast<float>((t * 5 + i * 2) % 9) - 4;
    Tensor gx = Tensor::empty({B, T * n, c}, DType::kF32, MemCategory::kWorkspace);
    Tensor ry = Tensor::empty({B, n, c}, DType::kF32, MemCategory::kWorkspace);
    tp.all_gather_seq(x, gx);
    TpComm::Pending p = tp.start_reduce_scatter_seq(y, ry);
    tp.wait(p);
    // Placement: element (b, r*n + i, j) of gx is rank r's x(b, i, j).
    for (int64_t b = 0; b < B; ++b)
      for (int r = 0; r < T; ++r)
        for (int64_t i = 0; i < n * c; ++i) {
          const float want = static_cast<float>((r * 7 + (b * n * c + i) * 3) % 11) - 5;
          ASSERT_EQ(gx.data<float>()[(b * T + r) * n * c + i], want) << "b " << b << " rank " << r << " i " << i;
        }
    double sums[2] = {0, 0};
    for (int64_t i = 0; i < gx.numel(); ++i) sums[0] += gx.data<float>()[i] * y.data<float>()[i];
    for (int64_t i = 0; i < x.numel(); ++i) sums[1] += x.data<float>()[i] * ry.data<float>()[i];
    ASSERT_TRUE(world.all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum).ok());
    EXPECT_EQ(sums[0], sums[1]) << (overlap ? "overlap" : "no overlap");
    // all_reduce is self-adjoint; its result is the sum on every rank.
    Tensor z = x.clone(MemCategory::kWorkspace);
    tp.all_reduce(z);
    for (int64_t i = 0; i < z.numel(); ++i) {
      double want = 0;
      for (int r = 0; r < T; ++r) want += static_cast<float>((r * 7 + i * 3) % 11) - 5;
      ASSERT_EQ(z.data<float>()[i], want) << i;
    }
  }
}

// ---- the ring attention pieces alone, as the sp axis calls them ----

Tensor random_global(const Shape& shape, uint64_t stream) {
  Tensor t = Tensor::empty(shape, DType::kF32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(normal_at(5, stream, i));
  return t;
}

// Rows `pos` of dim 1 of a [B, S, ...] tensor: [B, |pos|, ...].
Tensor rows_of(const Tensor& x, const std::vector<int32_t>& pos) {
  const int64_t B = x.dim(0), S = x.dim(1), row = x.numel() / (B * S), n = static_cast<int64_t>(pos.size());
  Shape shape = x.shape();
  shape[1] = n;
  Tensor out = Tensor::empty(shape, DType::kF32, MemCategory::kWorkspace);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(x.data<float>() + (b * S + pos[i]) * row, row, out.data<float>() + (b * n + i) * row);
  return out;
}

// lse [B, n, S] -> the columns `pos`: [B, n, |pos|].
Tensor lse_cols(const Tensor& lse, const std::vector<int32_t>& pos) {
  const int64_t B = lse.dim(0), n = lse.dim(1), S = lse.dim(2), m = static_cast<int64_t>(pos.size());
  Tensor out = Tensor::empty({B, n, m}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t r = 0; r < B * n; ++r)
    for (int64_t i = 0; i < m; ++i) out.data<float>()[r * m + i] = lse.data<float>()[r * S + pos[i]];
  return out;
}

void check_ring(SeqSplit split, bool overlap) {
  Communicator& world = test::mpi().world();
  const int N = world.size(), p = world.rank();
  const int64_t B = 2, S = 24 * N, n_h = 6, n_kv = 2, d = 8;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Tensor q = random_global({B, S, n_h, d}, 1), k = random_global({B, S, n_kv, d}, 2),
               v = random_global({B, S, n_kv, d}, 3), d_out = random_global({B, S, n_h, d}, 4);
  auto be = make_cpu_backend();
  // Reference: the whole sequence on one rank.
  Tensor pos_all = Tensor::empty({S}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < S; ++i) pos_all.data<int32_t>()[i] = static_cast<int32_t>(i);
  Tensor out = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({B, n_h, S}, DType::kF32, MemCategory::kWorkspace);
  const AttentionArgs all{&q, &k, &v, &pos_all, &pos_all, scale};
  be->attention_forward(all, out, lse);
  Tensor dq = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(k.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(v.shape(), DType::kF32, MemCategory::kWorkspace);
  be->attention_backward(all, out, lse, d_out, dq, dk, dv);

  // This rank's rows through the ring.
  const SequenceShard shard = SequenceShard::create(S, N, p, split);
  const std::vector<int32_t>& mine = shard.positions();
  const std::vector<int32_t> gathered = shard.gathered_positions();
  Tensor q_pos = Tensor::empty({static_cast<int64_t>(mine.size())}, DType::kI32, MemCategory::kWorkspace);
  Tensor k_pos = Tensor::empty({S}, DType::kI32, MemCategory::kWorkspace);
  std::copy(mine.begin(), mine.end(), q_pos.data<int32_t>());
  std::copy(gathered.begin(), gathered.end(), k_pos.data<int32_t>());
  const Tensor lq = rows_of(q, mine), lk = rows_of(k, mine), lv = rows_of(v, mine), ldo = rows_of(d_out, mine);
  StepTimer timer;
  RingAttentionArgs a;
  a.axis = &world;
  a.backend = be.get();
  a.q = &lq;
  a.k = &lk;
  a.v = &lv;
  a.q_pos = &q_pos;
  a.k_pos = &k_pos;
  a.q_positions = mine;
  a.k_positions = gathered;
  a.scale = scale;
  a.overlap = overlap;
  a.timer = &timer;
  Tensor l_out = Tensor::empty(lq.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor l_lse = Tensor::empty({B, n_h, static_cast<int64_t>(mine.size())}, DType::kF32, MemCategory::kWorkspace);
  ring_attention_forward(a, l_out, l_lse);
  Tensor l_dq = Tensor::empty(lq.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor l_dk = Tensor::empty(lk.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor l_dv = Tensor::empty(lv.shape(), DType::kF32, MemCategory::kWorkspace);
  ring_attention_backward(a, l_out, l_lse, ldo, l_dq, l_dk, l_dv);

  const struct {
    const char* name;
    Tensor got, want;
  } checks[] = {{"out", l_out, rows_of(out, mine)},  {"lse", l_lse, lse_cols(lse, mine)},
                {"dq", l_dq, rows_of(dq, mine)},     {"dk", l_dk, rows_of(dk, mine)},
                {"dv", l_dv, rows_of(dv, mine)}};
  for (const auto& ch : checks)
    EXPECT_LE(max_rel_error(ch.got, ch.want), tol::kF32Parallel)
        << ch.name << " on rank " << p << "\n" << describe_mismatches(ch.got, ch.want, tol::kF32Parallel);
  EXPECT_GE(timer.seconds(), 0.0);
}

TEST(RingAttention, MatchesAttentionOverTheWholeSequence) {
  for (SeqSplit split : {SeqSplit::kZigzag, SeqSplit::kContiguous})
    for (bool overlap : {true, false}) {
      SCOPED_TRACE(std::string(split == SeqSplit::kZigzag ? "zigzag" : "contiguous") + (overlap ? "" : " no-overlap"));
      check_ring(split, overlap);
    }
}

// ---- sizes that do not divide ----

// `options`: the layout's knobs in the grammar (":seqpar", ":contiguous", ":bf16").
std::string factory_error(const std::string& layout, const LlamaConfig& c, int64_t seq, const std::string& options,
                          StatusCode* code = nullptr) {
  const Layout o = test::megatron_layout(layout, options);
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), layout);
  FP_CHECK_OK(mesh.status());
  Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, *mesh, seq, o);
  if (code != nullptr) *code = m.ok() ? StatusCode::kOk : m.status().code();
  return m.ok() ? std::string("ok") : m.status().message();
}

// tp=T: every size tensor parallelism shards names itself; plain TP does not shard the
// sequence; sequence parallelism needs S % T.
TEST(MegatronErrors, TpSizesThatDoNotDivide) {
  const int T = test::mpi().world().size();
  if (T == 1) GTEST_SKIP() << "everything divides by 1";
  const std::string layout = "tp=" + std::to_string(T);
  const LlamaConfig c = test_config(Family::kTp, T, false, true, 2);
  const std::string plain, seqpar = ":seqpar";
  const std::string deg = "the tp degree (" + std::to_string(T) + ")";
  LlamaConfig bad = c;
  bad.num_attention_heads = T * 4 + 1;
  bad.num_key_value_heads = 1;
  bad.hidden_size = bad.num_attention_heads * 2;
  std::string msg = factory_error(layout, bad, 48, plain);
  EXPECT_NE(msg.find("num_attention_heads (" + std::to_string(T * 4 + 1) + ") must be divisible by " + deg),
            std::string::npos)
      << msg;
  bad = c;
  // n_kv neither a multiple of T nor dividing it (fewer KV heads than T that divide it are
  // KV replicas, accepted).
  bad.num_attention_heads = 12;
  bad.hidden_size = 96;
  bad.num_key_value_heads = T == 3 ? 2 : 3;
  msg = factory_error(layout, bad, 48, plain);
  EXPECT_NE(msg.find("num_key_value_heads (" + std::to_string(bad.num_key_value_heads) + ") must be divisible by " +
                     deg),
            std::string::npos)
      << msg;
  bad = c;
  bad.num_key_value_heads = 1;
  EXPECT_EQ(factory_error(layout, bad, 48, plain), "ok") << "KV replicas";
  bad = c;
  bad.intermediate_size = T * 10 + 1;
  msg = factory_error(layout, bad, 48, plain);
  EXPECT_NE(msg.find("intermediate_size (" + std::to_string(T * 10 + 1) + ") must be divisible by " + deg),
            std::string::npos)
      << msg;
  bad = c;
  bad.vocab_size = T * 10 + 1;
  msg = factory_error(layout, bad, 48, plain);
  EXPECT_NE(msg.find("vocab_size (" + std::to_string(T * 10 + 1) + ") must be divisible by " + deg), std::string::npos)
      << msg;
  const int64_t odd = 4 * T + 1;
  EXPECT_EQ(factory_error(layout, c, odd, plain), "ok") << "plain TP does not shard the sequence";
  StatusCode code = StatusCode::kOk;
  msg = factory_error(layout, c, odd, seqpar, &code);
  EXPECT_NE(msg.find("sequence length (" + std::to_string(odd) + ") must be divisible by " + deg +
                     " with sequence parallelism"),
            std::string::npos)
      << msg;
  EXPECT_EQ(code, StatusCode::kInvalidArgument);
}

// sp=S_: the split's divisibility (one sp rank takes any S).
TEST(MegatronErrors, SpSequenceThatDoesNotSplit) {
  const int D = test::mpi().world().size();
  const std::string layout = "sp=" + std::to_string(D);
  const LlamaConfig c = test_config(Family::kSp, 1, false, true, 1);
  auto message = [&](int64_t seq, SeqSplit split) {
    return factory_error(layout, c, seq, split == SeqSplit::kContiguous ? ":contiguous" : "");
  };
  if (D > 1) {
    const std::string zigzag = message(2 * D + 1, SeqSplit::kZigzag);
    EXPECT_NE(zigzag.find("sequence length (" + std::to_string(2 * D + 1) + ")"), std::string::npos) << zigzag;
    EXPECT_NE(zigzag.find("(2 x " + std::to_string(D) + " = " + std::to_string(2 * D) + ")"), std::string::npos)
        << zigzag;
    const std::string contiguous = message(D + 1, SeqSplit::kContiguous);
    EXPECT_NE(contiguous.find("sequence length (" + std::to_string(D + 1) + ")"), std::string::npos) << contiguous;
    EXPECT_NE(contiguous.find("sequence degree (" + std::to_string(D) + ")"), std::string::npos) << contiguous;
  } else {
    EXPECT_EQ(message(3, SeqSplit::kZigzag), "ok") << "one sp rank holds every position, whatever the split";
  }
  EXPECT_EQ(message(2 * D, SeqSplit::kZigzag), "ok");
  EXPECT_EQ(message(D, SeqSplit::kContiguous), "ok");
}

// The 2-D meshes: the tp sizes, the split over sp (S_ > 1), and sequence parallelism's S/S_ % T.
TEST(MegatronErrors, MeshSizesThatDoNotDivideNameTheNumbers) {
  if (layouts(Family::kMesh).empty()) GTEST_SKIP() << "the 2-D meshes are listed for 1, 2 and 4 ranks";
  for (const std::string& layout : layouts(Family::kMesh)) {
    SCOPED_TRACE(layout);
    const int T = degree_of(layout, "tp"), P = degree_of(layout, "sp");
    const LlamaConfig c = test_config(Family::kMesh, T, false, true, 1);
    const std::string plain;
    EXPECT_EQ(factory_error(layout, c, 48, plain), "ok");
    StatusCode code = StatusCode::kOk;
    if (T > 1) {
      const std::string deg = "the tp degree (" + std::to_string(T) + ")";
      LlamaConfig bad = c;
      bad.num_attention_heads = 5;
      bad.num_key_value_heads = 5;
      bad.hidden_size = 40;
      std::string msg = factory_error(layout, bad, 48, plain, &code);
      EXPECT_NE(msg.find("num_attention_heads (5) must be divisible by " + deg), std::string::npos) << msg;
      EXPECT_EQ(code, StatusCode::kInvalidArgument);
      bad = c;
      bad.num_attention_heads = 12;
      bad.hidden_size = 96;
      bad.num_key_value_heads = 3;  // neither a multiple of T = 2 nor dividing it
      msg = factory_error(layout, bad, 48, plain);
      EXPECT_NE(msg.find("num_key_value_heads (3) must be divisible by " + deg), std::string::npos) << msg;
      bad = c;
      bad.intermediate_size = 111;
      msg = factory_error(layout, bad, 48, plain);
      EXPECT_NE(msg.find("intermediate_size (111) must be divisible by " + deg), std::string::npos) << msg;
      bad = c;
      bad.vocab_size = 97;
      msg = factory_error(layout, bad, 48, plain);
      EXPECT_NE(msg.find("vocab_size (97) must be divisible by " + deg), std::string::npos) << msg;
    }
    // Zigzag needs S % 2 S_ (one sp rank holds every position in order).
    const int64_t odd = 2 * P + 1;  // never divisible by 2 S_
    std::string msg = factory_error(layout, c, odd, plain, &code);
    if (P == 1) {
      EXPECT_EQ(msg, "ok");
    } else {
      EXPECT_NE(msg.find("sequence length (" + std::to_string(odd) +
                         ") must be divisible by 2 x the sequence degree (2 x " + std::to_string(P) + " = " +
                         std::to_string(2 * P) + ")"),
                std::string::npos)
          << msg;
      EXPECT_EQ(code, StatusCode::kInvalidArgument);
    }
    // Sequence parallelism needs S/S_ % T (contiguous: S = 3 S_ gives 3 rows per sp rank).
    msg = factory_error(layout, c, 3 * P, ":seqpar:contiguous", &code);
    if (T == 1) {
      EXPECT_EQ(msg, "ok");  // sequence parallelism over one tp rank changes nothing
    } else if (P == 1) {
      EXPECT_NE(msg.find("sequence length (3) must be divisible by the tp degree (" + std::to_string(T) +
                         ") with sequence parallelism"),
                std::string::npos)
          << msg;
      EXPECT_EQ(code, StatusCode::kInvalidArgument);
    } else {
      EXPECT_NE(msg.find("sequence length (" + std::to_string(3 * P) + ") must be divisible by the sp degree x the tp "
                         "degree (" + std::to_string(P) + " x " + std::to_string(T) + " = " +
                         std::to_string(P * T) + ") with sequence parallelism"),
                std::string::npos)
          << msg;
      EXPECT_EQ(code, StatusCode::kInvalidArgument);
    }
  }
}

// A batch that is not this rank's rows is refused before any communication.
TEST(MegatronErrors, LocalBatchOfTheWrongLength) {
  const int W = test::mpi().world().size();
  for (Family f : {Family::kTp, Family::kSp, Family::kMesh})
    for (const std::string& layout : layouts(f)) {
      SCOPED_TRACE(layout);
      const Case k{.family = f, .sequence_parallel = f == Family::kTp};
      const LlamaConfig c = test_config(f, degree_of(layout, "tp"), false, true, 1);
      Built l = make_layout(layout, k, c);
      // tp=T with sequence parallelism and sp=S_: the global batch; the meshes: twice S.
      const int64_t S = f == Family::kMesh ? 2 * k.seq : k.seq;
      const Batch global = synthetic_batch(c, 1, S, 3);
      Result<StepResult> r = l.model->forward(*make_cpu_backend(), global);
      if (f != Family::kMesh && W == 1) {
        EXPECT_TRUE(r.ok()) << "one rank's rows are the global batch: " << r.status().to_string();
        continue;
      }
      ASSERT_FALSE(r.ok());
      EXPECT_NE(r.status().message().find("local batch has " + std::to_string(S) + " tokens per sequence"),
                std::string::npos)
          << r.status().to_string();
      if (f == Family::kSp) {
        EXPECT_NE(r.status().message().find("this rank holds " + std::to_string(k.seq / W)), std::string::npos)
            << r.status().message();
      }
    }
}

}  // namespace
}  // namespace foldpar
