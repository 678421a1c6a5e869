// Mixture-of-experts models under pp (pp=P over TSP or Megatron stages, parallel/pipeline/)
// against the single-rank MoE model. Each micro-batch has its own aux loss (gradient accumulation,
// docs/design.md "Mixture of experts"), a product of routing statistics over every sparse
// layer of every stage: the reference is the single-rank model micro-batch by micro-batch
// (micro-batch i is row i of every dp replica's share), weighted by its share v_i / N of
// the step's valid targets. Compared: the loss (with the aux term), the aux loss, the expert
// load, every assembled gradient (1e-5 rule) and the pp traffic exactly (the boundary's
// activations and gradients plus the routing statistics forward and the aux gradient back).
// Layouts by world size W: pp=2,tsp=1 and pp=2,tp=1 (W = 2); pp=2,tsp=2 with each dispatch
// scheme, pp=4,tsp=1, pp=2,dp=2,tsp=1, and the Megatron stages pp=2,tp=2, pp=2,tp=2:seqpar and
// pp=2,sp=2 (experts over the tp x sp group; W = 4); pp=2,dp=2,tsp=2, pp=2,tp=2,sp=2 (its
// expert axis split off the world) and pp=2,dp=2,tp=2 (W = 8); 1F1B and interleaved:2, m = p
// and 2p, Mixtral-, Qwen2-MoE- (shared expert, dense layers on the last stage only) and
// Qwen3-MoE-like (decoder_sparse_step) configs, the HF and the per-layer aux modes, uneven
// stages. In bf16 storage on TSP and Megatron stages against the single-rank model in bf16
// and f32 (moe_bf16_rules.h's tolerances and routing margin). Experts over dp replicas (ep >
// the model group) per stage: pp=2,dp=2,tsp=1,ep=2 and pp=2,dp=2,tp=1,ep=2 (W = 4);
// pp=2,dp=2,tsp=2,ep=4, pp=2,dp=2,tp=2|sp=2,ep=4, pp=2,dp=4,tsp=1|tp=1,ep=2 (W = 8), with the
// assembled weights exact and a negative control (expert gradients over the whole dp axis);
// the expert-weight ring over the stage's expert group (moe=ring) on pp=2,dp=2,tsp=1,ep=2
// (W = 4), pp=2,dp=2,tsp=2,ep=4 and pp=2,dp=4,tsp=1,ep=2 (W = 8), 1F1B and interleaved:2;
// moe=auto over the stage's group on both sides of the bytes rule, the group's traffic
// naming the scheme that ran.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "core/tolerance.h"
#include "moe_bf16_rules.h"
#include "moe_checks.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "tensor/compare.h"
#include "train/trainer.h"

namespace foldpar {
namespace {

// Four layers (two stages x two chunks), E = 4 experts over tsp <= 4.
LlamaConfig moe_config(MoeFamily family) {
  LlamaConfig c;
  c.hidden_size = 32;  // d = 8
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.intermediate_size = 24;
  c.num_hidden_layers = 4;
  c.vocab_size = 64;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  MoeConfig& m = c.moe;
  m.family = family;
  m.num_experts = 4;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = family == MoeFamily::kMixtral ? c.intermediate_size : 12;
  m.norm_topk_prob = family != MoeFamily::kQwen2;
  m.router_aux_loss_coef = 0.25;  // large, so that the aux gradient shows in every comparison
  m.output_router_logits = true;
  if (family == MoeFamily::kQwen2) {
    m.shared_expert_intermediate_size = 16;
    m.mlp_only_layers = {2, 3};  // layers 0 and 1 sparse (stage 0 of two), 2 and 3 dense
  }
  if (family == MoeFamily::kQwen3) m.decoder_sparse_step = 2;  // layers 1 and 3 sparse
  return c;
}

struct Case {
  std::string layout{};  // run where its ranks equal the world size
  MoeFamily family = MoeFamily::kMixtral;
  int m_per_stage = 1;   // m = this x p micro-batches
  int chunks = 1;        // v > 1: interleaved
  std::vector<int> stages{};
  bool per_layer = false;
  bool aux_in_loss = true;  // output_router_logits
  Recompute recompute = Recompute::kNone;
  // Negative control of experts over dp replicas (ep > the model group): the routed experts'
  // gradients summed over the whole dp axis instead of their stage's expert-data replicas.
  bool experts_over_whole_dp = false;
  int64_t expert_width = 0;  // f_e instead of the config's (0: keep)
  // ep over dp: the scheme the stage must have run over its expert group ("a2a", "gather",
  // "ring"), seen in the group's traffic; null: not checked.
  const char* runs = nullptr;
  double capacity_factor = 0;  // > 0: moe_capacity_factor, in the reference and on the stages
};

const InitOptions kInit{.seed = 5, .std = 0.1, .norm_jitter = 0.2};
constexpr int64_t kSeq = 16;

// Rows `picks` of an i32 [R, S] tensor, stacked.
Tensor pick_rows(const Tensor& t, const std::vector<int64_t>& picks) {
  const int64_t S = t.dim(1);
  Tensor out = Tensor::empty({static_cast<int64_t>(picks.size()), S}, DType::kI32, MemCategory::kWorkspace);
  for (size_t i = 0; i < picks.size(); ++i)
    std::copy_n(t.data<int32_t>() + picks[i] * S, S, out.data<int32_t>() + static_cast<int64_t>(i) * S);
  return out;
}

struct Reference {
  LlamaWeights grads;
  double loss = 0, aux = 0;  // sum_i (v_i / N) loss_i, likewise aux_i
  std::vector<int64_t> load;  // summed over the micro-batches
};

// Replica d's m micro-batches of one sequence each (rows d*m .. d*m+m-1 of the global
// batch), as this rank's model shards them.
std::vector<Batch> replica_micro_batches(ShardedModel& model, const Batch& global, int d, int m) {
  std::vector<Batch> locals;
  for (int i = 0; i < m; ++i) {
    const int64_t row = static_cast<int64_t>(d) * m + i;
    locals.push_back(
        model.local_batch(Batch{global.input_ids.narrow(row, row + 1), global.target_ids.narrow(row, row + 1)}));
  }
  return locals;
}

// The single-rank model micro-batch by micro-batch: micro-batch i is row i of each replica's
// block of m rows (replica d holds global rows [d m, (d + 1) m)).
Reference reference(const LlamaConfig& c, const LlamaWeights& w, const Batch& global, int m, int dp, int64_t N,
                    Backend& be) {
  Reference ref;
  ref.grads = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref.grads.zero();
  ref.load.assign(static_cast<size_t>(c.moe.num_experts), 0);
  std::vector<Tensor> sum;
  ref.grads.for_each([&](const std::string&, Tensor& t) { sum.push_back(t); });
  for (int i = 0; i < m; ++i) {
    std::vector<int64_t> picks;
    for (int d = 0; d < dp; ++d) picks.push_back(static_cast<int64_t>(d) * m + i);
    const Batch part{pick_rows(global.input_ids, picks), pick_rows(global.target_ids, picks)};
    LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
    g.zero();
    Result<StepResult> r = model_forward_backward(c, be, w, part, StepOptions{}, g);
    FP_CHECK_OK(r.status());
    const double share = static_cast<double>(r->valid_tokens) / static_cast<double>(N);
    ref.loss += share * r->loss;
    ref.aux += share * r->aux_loss;
    for (size_t e = 0; e < ref.load.size(); ++e) ref.load[e] += r->expert_load[e];
    size_t k = 0;
    g.for_each([&](const std::string&, Tensor& t) {
      for (int64_t j = 0; j < t.numel(); ++j)
        sum[k].data<float>()[j] += static_cast<float>(share * static_cast<double>(t.data<float>()[j]));
      ++k;
    });
  }
  return ref;
}

// Traffic on pp, exactly: per chunk boundary m activations of `act` bytes forward, each
// followed by the routing statistics (sparse layers x (2E + 2) f64), and m gradients back,
// each followed by the aux gradient (sparse layers x E f64) when the aux term is in the loss;
// the loss broadcast once (4 + E f64). s: this rank's stage.
void expect_pp_traffic(const CommStats& pp_traffic, const Layout& lo, const LlamaConfig& c, bool aux_in_loss, int m,
                       int s, uint64_t act) {
  const int P = lo.pp;
  const uint64_t sparse = static_cast<uint64_t>(c.moe.sparse_layer_count(c.num_hidden_layers));
  const uint64_t E = static_cast<uint64_t>(c.moe.num_experts);
  const uint64_t stats = sparse * (2 * E + 2) * 8, grad = aux_in_loss ? sparse * E * 8 : 0;
  uint64_t forward = 0, backward = 0;
  for (int ch = 0; ch < lo.chunks; ++ch) {
    const int g = ch * P + s;
    forward += g < P * lo.chunks - 1 ? static_cast<uint64_t>(m) : 0;
    backward += g > 0 ? static_cast<uint64_t>(m) : 0;
  }
  EXPECT_EQ(pp_traffic.op(CommOpKind::kSend).bytes_sent, forward * (act + stats) + backward * (act + grad))
      << "stage " << s;
  EXPECT_EQ(pp_traffic.op(CommOpKind::kSend).calls, 2 * forward + (aux_in_loss ? 2 : 1) * backward);
  // Received: an activation (and statistics) into each chunk but the model's first, a
  // gradient (and aux gradient) into each but its last.
  uint64_t in_forward = 0, in_backward = 0;
  for (int ch = 0; ch < lo.chunks; ++ch) {
    const int g = ch * P + s;
    in_forward += g > 0 ? static_cast<uint64_t>(m) : 0;
    in_backward += g < P * lo.chunks - 1 ? static_cast<uint64_t>(m) : 0;
  }
  EXPECT_EQ(pp_traffic.op(CommOpKind::kRecv).bytes_received, in_forward * (act + stats) + in_backward * (act + grad));
  EXPECT_EQ(pp_traffic.op(CommOpKind::kBroadcast).calls, 1u);
}

// Runs a case if the world has its ranks; false (skipped) otherwise.
bool check_parity(const Case& k) {
  Communicator& world = test::mpi().world();
  Layout lo = parse_layout(k.layout).value();
  if (lo.ranks() != world.size()) return false;
  lo.chunks = k.chunks;
  lo.stage_layers = k.stages;
  lo.recompute = k.recompute;
  SCOPED_TRACE(testing::Message() << lo.to_string() << " family " << static_cast<int>(k.family) << " m/p "
                                  << k.m_per_stage << (k.per_layer ? " per-layer aux" : "")
                                  << (k.aux_in_loss ? "" : " without the aux term"));
  LlamaConfig c = moe_config(k.family);
  c.moe.aux_per_layer = k.per_layer;
  c.moe.output_router_logits = k.aux_in_loss;
  if (k.expert_width > 0) c.moe.moe_intermediate_size = k.expert_width;
  c.moe.capacity_factor = k.capacity_factor;
  const int m = k.m_per_stage * lo.pp;
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const Batch global = synthetic_batch(c, static_cast<int64_t>(m) * lo.dp, kSeq, 13, 0.1);
  auto be = make_cpu_backend();
  const int64_t N = be->count_valid_targets(global.target_ids, kIgnoreIndex);
  const Reference ref = reference(c, w, global, m, lo.dp, N, *be);
  EXPECT_GT(ref.aux, 0.0);

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  FP_CHECK_OK(mesh.status());
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, kSeq, lo);
  FP_CHECK_OK(made.status());
  ShardedModel& model = **made;
  model.init_weights(kInit);
  model.zero_grads(*be);
  const int d = mesh->coord("dp");
  const std::vector<Batch> locals = replica_micro_batches(model, global, d, m);
  ScopedCommCounter counter({&mesh->comm("pp")});
  const std::vector<const Communicator*> beside = model.communicators_beside_mesh();
  EXPECT_TRUE(k.runs == nullptr || !beside.empty()) << "the scheme is checked on an expert group's traffic";
  std::optional<ScopedCommCounter> group_traffic;
  if (k.runs != nullptr && !beside.empty()) group_traffic.emplace(*beside.front());  // the stage's "ep"
  Result<StepResult> got = model.forward_backward_micro_batches(*be, locals, N);
  FP_CHECK_OK(got.status());
  const CommStats pp_traffic = counter.delta();
  if (group_traffic) {
    // Each scheme's own calls on the group: the all-to-all's counts exchange (its rows go by
    // send and recv), the gather's all_gather, the ring's send_recv hops.
    const CommStats t = group_traffic->delta();
    const std::string runs = k.runs;
    EXPECT_EQ(t.op(CommOpKind::kAllToAll).calls > 0, runs == "a2a") << runs;
    EXPECT_EQ(t.op(CommOpKind::kAllGather).calls > 0, runs == "gather") << runs;
    EXPECT_EQ(t.op(CommOpKind::kSendRecv).calls > 0, runs == "ring") << runs << "\n" << t.to_string();
  }

  // Loss and aux loss: each replica's sums over its valid targets; over dp, the global batch's.
  double sums[3] = {got->loss_sum, static_cast<double>(got->valid_tokens),
                    got->aux_loss * static_cast<double>(got->valid_tokens)};
  if (lo.dp > 1) FP_CHECK_OK(mesh->comm("dp").all_reduce(sums, sums, 3, DType::kF64, ReduceOp::kSum));
  EXPECT_EQ(static_cast<int64_t>(sums[1]), N);
  EXPECT_NEAR(sums[0] / sums[1], ref.loss, tol::kF32Parallel * ref.loss);
  EXPECT_NEAR(sums[2] / sums[1], ref.aux, tol::kF32Parallel * ref.aux);
  EXPECT_EQ(got->expert_load, ref.load);

  std::vector<ParamRef> params = model.parameters();
  // The trainer's sum: with experts over dp replicas (ep), the routed experts over the
  // stage's replicas holding them.
  sum_grads_over_data_axis(lo.dp > 1 ? &mesh->comm("dp") : nullptr, params,
                           k.experts_over_whole_dp ? nullptr : model.expert_data_axis());
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  FP_CHECK_OK(model.assemble_grads(assembled));
  std::vector<std::pair<std::string, Tensor>> ref_list;
  const_cast<LlamaWeights&>(ref.grads).for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  if (k.experts_over_whole_dp) {
    test::expect_experts_off(assembled, ref_list);
    return true;
  }
  // The weights assemble to the single-rank model's exactly (each expert from its owner, over
  // the stages and the expert group's replicas).
  LlamaWeights weights = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  FP_CHECK_OK(model.assemble_weights(weights));
  test::expect_weights_exact(weights, w);
  size_t i = 0, routers = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    EXPECT_EQ(name, ref_list[i].first);
    if (name.find(".gate.weight") != std::string::npos) ++routers;
    EXPECT_LE(max_rel_error(t, ref_list[i].second), tol::kF32Parallel)
        << name << " on rank " << world.rank() << "\n"
        << describe_mismatches(t, ref_list[i].second, tol::kF32Parallel);
    ++i;
  });
  EXPECT_GT(routers, 0u);

  expect_pp_traffic(pp_traffic, lo, c, k.aux_in_loss, m, mesh->coord("pp"),
                    static_cast<uint64_t>(locals[0].input_ids.numel() * c.hidden_size * 4));
  return true;
}

#define RUN_OR_SKIP(...)                                                                 \
  do {                                                                                   \
    bool ran = false;                                                                    \
    for (const Case& k : std::vector<Case>{__VA_ARGS__}) ran = check_parity(k) || ran;  \
    if (!ran) GTEST_SKIP() << "no case for " << test::mpi().world().size() << " ranks";  \
  } while (0)

TEST(PipelineMoeParity, OneFOneBWithMEqualToPAndTwiceP) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1"}, Case{.layout = "pp=2,tsp=1", .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2:moe=a2a", .m_per_stage = 2}, Case{.layout = "pp=4,tsp=1"},
              Case{.layout = "pp=4,tsp=1", .m_per_stage = 2});
}

TEST(PipelineMoeParity, EveryDispatchOnTspStages) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .family = MoeFamily::kQwen2, .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2:moe=a2a"}, Case{.layout = "pp=2,tsp=2:moe=gather", .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2:moe=ring", .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2:moe=gather", .family = MoeFamily::kQwen2},
              Case{.layout = "pp=2,tsp=2:moe=ring", .family = MoeFamily::kQwen3, .per_layer = true});
}

// moe_capacity_factor 0.5 (4 of a sequence's 32 pairs per expert): each micro-batch's whole
// sequences, counted across a stage's ranks, on TSP and Megatron stages.
TEST(PipelineMoeParity, CapacityOnTspAndMegatronStages) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .m_per_stage = 2, .capacity_factor = 0.5},
              Case{.layout = "pp=2,tsp=2:moe=ring", .capacity_factor = 0.5},
              Case{.layout = "pp=2,tsp=2:moe=gather", .family = MoeFamily::kQwen2, .capacity_factor = 0.75},
              Case{.layout = "pp=2,sp=2", .m_per_stage = 2, .capacity_factor = 0.5},
              Case{.layout = "pp=2,tp=2:seqpar", .capacity_factor = 0.5});
}

TEST(PipelineMoeParity, InterleavedChunks) {
  // Rank s holds chunks s and s + 2: the statistics leave it and come back to it.
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .m_per_stage = 2, .chunks = 2},
              Case{.layout = "pp=2,tsp=1", .family = MoeFamily::kQwen3, .m_per_stage = 1, .chunks = 2},
              Case{.layout = "pp=2,tsp=2:moe=a2a", .m_per_stage = 2, .chunks = 2},
              Case{.layout = "pp=2,tsp=2:moe=ring", .family = MoeFamily::kQwen2, .chunks = 2});
}

TEST(PipelineMoeParity, PerLayerAuxUnevenStagesRecomputeAndNoAuxTerm) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .per_layer = true},
              Case{.layout = "pp=2,tsp=1", .family = MoeFamily::kQwen3, .stages = {3, 1}},
              Case{.layout = "pp=2,tsp=1", .m_per_stage = 2, .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,tsp=1", .m_per_stage = 2, .aux_in_loss = false},
              Case{.layout = "pp=2,tsp=2:moe=gather", .stages = {1, 3}, .per_layer = true},
              Case{.layout = "pp=2,tsp=2:moe=a2a", .m_per_stage = 2, .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,tsp=2:moe=ring", .aux_in_loss = false});
}

TEST(PipelineMoeParity, WithDataParallel) {
  RUN_OR_SKIP(Case{.layout = "pp=2,dp=2,tsp=1", .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,tsp=1", .family = MoeFamily::kQwen2, .chunks = 2},
              Case{.layout = "pp=2,dp=2,tsp=2:moe=a2a"},
              Case{.layout = "pp=2,dp=2,tsp=2:moe=ring", .family = MoeFamily::kQwen3, .m_per_stage = 2});
}

// ---- bf16 storage (:bf16) ----
//
// The stages store weights and activations in bf16 and compute through the bf16 storage
// decorator, as `train --bf16` runs them; the boundary moves bf16 activations (2 bytes an
// element) and the same f64 side messages. Against the single-rank model micro-batch by
// micro-batch in bf16 and in f32 with the same weights, within moe_bf16_rules.h's tolerances
// (the loss and aux loss 1 bf16 ulp, gradients 16, routers 32; derived there) over its
// routing margin, so the expert load equals the references' exactly.
void check_bf16_parity(const Case& k) {
  Communicator& world = test::mpi().world();
  Layout lo = parse_layout(k.layout).value();
  lo.chunks = k.chunks;
  SCOPED_TRACE(testing::Message() << lo.to_string() << " family " << static_cast<int>(k.family) << " m/p "
                                  << k.m_per_stage << (k.per_layer ? " per-layer aux" : ""));
  LlamaConfig c = moe_config(k.family);
  c.moe.aux_per_layer = k.per_layer;
  const int m = k.m_per_stage * lo.pp;
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  LlamaWeights w32 = test::moe_margin_weights(c, kInit);
  const LlamaWeights w16 = test::converted_weights(c, w32, DType::kBF16);
  const Batch global = synthetic_batch(c, static_cast<int64_t>(m) * lo.dp, kSeq, 13, 0.1);
  const int64_t N = cpu->count_valid_targets(global.target_ids, kIgnoreIndex);
  const Reference want = reference(c, w16, global, m, lo.dp, N, *bf);
  const Reference f32 = reference(c, w32, global, m, lo.dp, N, *cpu);
  ASSERT_EQ(want.load, f32.load) << "the margin keeps bf16 and f32 routing alike";

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, kSeq, lo);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ShardedModel& model = **made;
  test::load_global(model.parameters(), w32);
  model.zero_grads(*cpu);
  const int d = mesh->coord("dp");
  const std::vector<Batch> locals = replica_micro_batches(model, global, d, m);
  ScopedCommCounter counter({&mesh->comm("pp")});
  Result<StepResult> got = model.forward_backward_micro_batches(*bf, locals, N);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  const CommStats pp_traffic = counter.delta();
  double sums[3] = {got->loss_sum, static_cast<double>(got->valid_tokens),
                    got->aux_loss * static_cast<double>(got->valid_tokens)};
  if (lo.dp > 1) FP_CHECK_OK(mesh->comm("dp").all_reduce(sums, sums, 3, DType::kF64, ReduceOp::kSum));
  EXPECT_EQ(static_cast<int64_t>(sums[1]), N);
  for (const Reference* ref : {&want, &f32}) {
    // bf16: one ulp of the loss and of the aux loss (moe_bf16_rules.h).
    EXPECT_NEAR(sums[0] / sums[1], ref->loss, test::kBf16LossTol * ref->loss);
    EXPECT_NEAR(sums[2] / sums[1], ref->aux, test::kBf16LossTol * ref->aux);
  }
  EXPECT_EQ(got->expert_load, want.load);

  std::vector<ParamRef> params = model.parameters();
  sum_grads_over_data_axis(lo.dp > 1 ? &mesh->comm("dp") : nullptr, params);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<Tensor> wg, fg;
  const_cast<LlamaWeights&>(want.grads).for_each([&](const std::string&, Tensor& t) { wg.push_back(t); });
  const_cast<LlamaWeights&>(f32.grads).for_each([&](const std::string&, Tensor& t) { fg.push_back(t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    // bf16: 16 ulp, the routers' 32 (moe_bf16_rules.h).
    const double tol = name.ends_with(".gate.weight") ? test::kBf16RouterTol : test::kBf16TensorTol;
    EXPECT_LE(max_rel_error(t, wg[i]), tol) << name << " on rank " << world.rank() << " against bf16\n"
                                            << describe_mismatches(t, wg[i], tol);
    EXPECT_LE(max_rel_error(t, fg[i]), tol) << name << " on rank " << world.rank() << " against f32\n"
                                            << describe_mismatches(t, fg[i], tol);
    ++i;
  });
  EXPECT_EQ(i, wg.size());
  expect_pp_traffic(pp_traffic, lo, c, true, m, mesh->coord("pp"),
                    static_cast<uint64_t>(locals[0].input_ids.numel() * c.hidden_size * 2));
}

// TSP and Megatron stages in bf16 at each world size (skipped where the world has no case).
TEST(PipelineMoeBf16Parity, TspAndMegatronStages) {
  const std::vector<Case> cases{
      Case{.layout = "pp=2,tsp=1:bf16", .m_per_stage = 2},
      Case{.layout = "pp=2,tp=1:bf16", .family = MoeFamily::kQwen2, .chunks = 2},
      Case{.layout = "pp=2,tsp=2:bf16:moe=a2a", .family = MoeFamily::kQwen2, .m_per_stage = 2},
      Case{.layout = "pp=2,tsp=2:bf16:moe=ring", .family = MoeFamily::kQwen3, .chunks = 2},
      Case{.layout = "pp=2,tp=2:bf16", .m_per_stage = 2},
      Case{.layout = "pp=2,tp=2:seqpar:bf16", .family = MoeFamily::kQwen2, .chunks = 2},
      Case{.layout = "pp=2,sp=2:bf16", .family = MoeFamily::kQwen3, .per_layer = true},
      Case{.layout = "pp=2,dp=2,tsp=2:bf16:moe=gather", .family = MoeFamily::kQwen2},
      Case{.layout = "pp=2,tp=2,sp=2:bf16", .m_per_stage = 2}};
  bool ran = false;
  for (const Case& k : cases)
    if (parse_layout(k.layout).value().ranks() == test::mpi().world().size()) {
      check_bf16_parity(k);
      ran = true;
    }
  if (!ran) GTEST_SKIP() << "no case for " << test::mpi().world().size() << " ranks";
}

// Megatron stages: each micro-batch's MegatronStep records its own routing statistics; the
// last stage sums them over the expert axis (tp x sp) and dp.
TEST(PipelineMoeParity, MegatronStages) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tp=1", .m_per_stage = 2},
              Case{.layout = "pp=2,tp=1", .family = MoeFamily::kQwen2, .chunks = 2},
              Case{.layout = "pp=2,tp=2"}, Case{.layout = "pp=2,tp=2", .family = MoeFamily::kQwen2, .m_per_stage = 2},
              Case{.layout = "pp=2,sp=2", .m_per_stage = 2},
              Case{.layout = "pp=2,sp=2", .family = MoeFamily::kQwen3, .per_layer = true},
              Case{.layout = "pp=2,tp=2:seqpar", .m_per_stage = 2},
              Case{.layout = "pp=2,tp=2:seqpar", .family = MoeFamily::kQwen2, .per_layer = true},
              Case{.layout = "pp=2,tp=2,sp=2", .m_per_stage = 2},
              Case{.layout = "pp=2,tp=2,sp=2:seqpar", .family = MoeFamily::kQwen2, .per_layer = true});
}

TEST(PipelineMoeParity, MegatronStagesInterleavedRecomputeAndNoAuxTerm) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tp=2", .m_per_stage = 2, .chunks = 2},
              Case{.layout = "pp=2,sp=2", .family = MoeFamily::kQwen2, .chunks = 2},
              Case{.layout = "pp=2,tp=2:seqpar", .family = MoeFamily::kQwen3, .m_per_stage = 2, .chunks = 2},
              Case{.layout = "pp=2,tp=2", .stages = {3, 1}, .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,sp=2", .m_per_stage = 2, .aux_in_loss = false},
              Case{.layout = "pp=2,tp=2,sp=2", .family = MoeFamily::kQwen3, .chunks = 2});
}

TEST(PipelineMoeParity, MegatronStagesWithDataParallel) {
  RUN_OR_SKIP(Case{.layout = "pp=2,dp=2,tp=1", .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,tp=2", .family = MoeFamily::kQwen2, .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,sp=2", .chunks = 2});
}

// Experts over dp replicas under pp (ep = K G): each stage's expert group is K consecutive dp
// replicas of that stage's model group, its MoE layers dispatch over it, and the routed
// experts' gradients sum over the stage's dp/K replicas holding them. dp=4 with ep=2 G makes
// that sum real (two replicas per expert); dp=2 with ep=2 G leaves each expert on one.
TEST(PipelineMoeParity, ExpertsOverDataParallelReplicas) {
  RUN_OR_SKIP(Case{.layout = "pp=2,dp=2,tsp=1,ep=2", .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,tsp=1,ep=2", .family = MoeFamily::kQwen2, .chunks = 2},
              Case{.layout = "pp=2,dp=2,tp=1,ep=2", .family = MoeFamily::kQwen3, .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,tsp=2,ep=4:moe=a2a", .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,tsp=2,ep=4:moe=gather", .family = MoeFamily::kQwen2},
              Case{.layout = "pp=2,dp=4,tsp=1,ep=2", .family = MoeFamily::kQwen3, .chunks = 2},
              Case{.layout = "pp=2,dp=2,tp=2,ep=4", .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,sp=2,ep=4", .family = MoeFamily::kQwen2},
              Case{.layout = "pp=2,dp=4,tp=1,ep=2", .m_per_stage = 2});
}

// The expert-weight ring over each stage's expert group (moe=ring, ep = K D): each block of
// E/ep experts visits the group's K D ranks (K dp replicas of the stage), every rank applying
// it to its own micro-batch's rows; the gradient ring brings each block's sum over the K
// replicas home, and the trainer's sum over the stage's expert-data replicas completes it.
// The K replicas run the stage's schedule in step, so each micro-batch's hops meet.
TEST(PipelineMoeParity, ExpertWeightRingOverDataParallelReplicas) {
  RUN_OR_SKIP(Case{.layout = "pp=2,dp=2,tsp=1,ep=2:moe=ring", .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,tsp=1,ep=2:moe=ring", .family = MoeFamily::kQwen2, .chunks = 2},
              Case{.layout = "pp=2,dp=2,tsp=1,ep=2:moe=ring", .family = MoeFamily::kQwen3, .per_layer = true,
                   .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,dp=2,tsp=2,ep=4:moe=ring", .m_per_stage = 2},
              Case{.layout = "pp=2,dp=2,tsp=2,ep=4:moe=ring", .family = MoeFamily::kQwen3, .chunks = 2},
              Case{.layout = "pp=2,dp=4,tsp=1,ep=2:moe=ring", .family = MoeFamily::kQwen2, .m_per_stage = 2});
}

// moe=auto over each stage's expert group: the bytes rule over its X = ep ranks on each
// micro-batch's own T = 16 rows a rank (tsp=1): Mixtral's f_e = 24 (108 rows) the all-to-all,
// f_e = 2 (9 rows) the ring; at tsp=2, T = 8: f_e = 1 (4.5 rows) the ring. Mixtral only:
// every stage holds sparse layers, so every rank's group traffic shows its scheme (Qwen2's
// last stage and Qwen3's interleaved stage 0 here have none).
TEST(PipelineMoeParity, AutoOverEachStagesExpertGroup) {
  RUN_OR_SKIP(Case{.layout = "pp=2,dp=2,tsp=1,ep=2", .runs = "a2a"},
              Case{.layout = "pp=2,dp=2,tsp=1,ep=2", .m_per_stage = 2, .expert_width = 2, .runs = "ring"},
              Case{.layout = "pp=2,dp=2,tsp=1,ep=2", .chunks = 2, .per_layer = true, .expert_width = 2,
                   .runs = "ring"},
              Case{.layout = "pp=2,dp=2,tsp=2,ep=4", .m_per_stage = 2, .expert_width = 1, .runs = "ring"},
              Case{.layout = "pp=2,dp=4,tsp=1,ep=2", .expert_width = 2, .runs = "ring"});
}

TEST(PipelineMoeParity, NegativeControlExpertGradientsOverTheWholeDataAxis) {
  RUN_OR_SKIP(Case{.layout = "pp=2,dp=2,tsp=1,ep=2", .experts_over_whole_dp = true},
              Case{.layout = "pp=2,dp=4,tsp=1,ep=2", .experts_over_whole_dp = true},
              Case{.layout = "pp=2,dp=2,tp=2,ep=4", .experts_over_whole_dp = true},
              Case{.layout = "pp=2,dp=2,tsp=1,ep=2:moe=ring", .experts_over_whole_dp = true},
              Case{.layout = "pp=2,dp=4,tsp=1,ep=2:moe=ring", .experts_over_whole_dp = true});
}

// What stays refused under pp, by name: ZB-H1 (the MoE backward does not split), on either
// stage. (Generation under pp on TSP stages runs: tests/parallel/pipeline_decode_test.cc.)
TEST(PipelineMoeLayout, RefusalsNameTheReason) {
  const LlamaConfig c = moe_config(MoeFamily::kMixtral);
  for (const char* ok : {"pp=2,tsp=1", "pp=2,tsp=2:moe=ring", "pp=2,dp=2,tsp=2", "pp=2,tsp=2:interleaved=2",
                         "pp=4,tsp=1:bf16", "pp=2,tp=2", "pp=2,sp=2:interleaved=2", "pp=2,tp=2,sp=2:seqpar",
                         "pp=2,dp=2,tp=2:bf16", "pp=2,dp=2,tsp=2,ep=4", "pp=2,dp=2,tp=2,ep=4",
                         "pp=2,dp=2,tsp=2,ep=4:moe=ring"})
    EXPECT_TRUE(validate_layout(c, parse_layout(ok).value(), 4, 16).ok()) << ok;
  for (const char* layout : {"pp=2,tsp=2:zb", "pp=2,tp=2:zb"}) {
    const Status zb = validate_layout(c, parse_layout(layout).value(), 4, 16);
    EXPECT_EQ(zb.code(), StatusCode::kUnimplemented);
    EXPECT_EQ(zb.message(),
              fmt::format("layout {}: the zero-bubble schedule (zb) does not split a mixture-of-experts layer's "
                          "backward (its expert gradients travel with the dispatch); use 1f1b or interleaved:N",
                          layout));
  }
}

}  // namespace
}  // namespace foldpar
