// Expert parallelism on the Megatron baselines (parallel/megatron/tp_moe.cc) against the
// single-rank MoE model: tp=T, tp=T:seqpar, sp=Q, tp=T,sp=Q, with dp=R where the ranks
// allow, built by make_sharded_model as train builds them. The experts spread over the
// tp x sp group (E/(T Q) whole experts per rank, or T Q / E ranks per expert each with a
// slice of its f_e when T Q > E). Each case: the loss with the aux term, the aux loss, the
// per-expert load, and every gradient assembled from the shards (after the trainer's sum
// over dp), within kF32Parallel of the single-rank model on the global batch; a forward alone
// too. Mixtral-like, Qwen2-MoE-like (shared expert, a dense layer among the sparse ones) and
// Qwen3-MoE-like (decoder_sparse_step, per-layer aux) tiny configs; a zero router (every
// token to experts 0 and 1: the ranks owning the others receive no rows and still take
// part). Negative control: two experts of each rank traded places must fail the comparison.
// Also: recompute, gradient accumulation, bf16 storage against the single-rank model in bf16
// and f32 (tsp_moe_parity_test.cc's rules), and the dispatch's bytes for a counted routing
// (generation on tp=N: decode_test.cc). Run under mpirun at 2 and 4 ranks; each layout runs
// where its ranks are the world's.
#include <gtest/gtest.h>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "comm/mesh.h"
#include "core/tolerance.h"
#include "moe_bf16_rules.h"
#include "moe_checks.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

LlamaConfig moe_config(MoeFamily family) {
  LlamaConfig c;
  c.hidden_size = 32;  // d = 8
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
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
    c.num_hidden_layers = 3;
    m.shared_expert_intermediate_size = 16;
    m.mlp_only_layers = {2};  // layers 0 and 1 sparse, 2 dense (Megatron's MLP)
  }
  if (family == MoeFamily::kQwen3) {
    c.num_hidden_layers = 3;
    m.decoder_sparse_step = 2;  // only layer 1 sparse
    m.aux_per_layer = true;
  }
  return c;
}

const InitOptions kInit{.seed = 5, .std = 0.1, .norm_jitter = 0.2};

struct Case {
  const char* layout;
  MoeFamily family = MoeFamily::kMixtral;
  bool zero_router = false;
  int64_t experts = 0;  // E instead of the config's 4 (0: keep); E < T Q splits each expert
  int64_t top_k = 0;    // k instead of the config's 2 (0: keep)
  bool swap_experts = false;  // negative control: each rank's first two experts trade places
  // Negative control (ep over dp): the routed experts' gradients summed over the whole dp
  // axis, as a dense gradient's, instead of over the replicas holding the same experts.
  bool experts_over_whole_dp = false;
  double capacity_factor = 0;  // > 0: moe_capacity_factor, in the reference and on the layout
};

// Returns false when the layout does not fit the world.
bool check(const Case& k) {
  Communicator& world = test::mpi().world();
  const Layout lo = parse_layout(k.layout).value();
  if (lo.ranks() != world.size()) return false;
  SCOPED_TRACE(testing::Message() << k.layout << " family " << static_cast<int>(k.family)
                                  << (k.zero_router ? " zero router" : "") << " E=" << k.experts);
  LlamaConfig c = moe_config(k.family);
  if (k.experts > 0) c.moe.num_experts = k.experts;
  if (k.top_k > 0) c.moe.num_experts_per_tok = k.top_k;
  c.moe.capacity_factor = k.capacity_factor;
  const int64_t B = 4, S = 16;  // B / dp sequences per replica

  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  if (k.zero_router)
    for (auto& l : w.layers)
      if (l.moe.defined()) l.moe.router.zero();
  Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  Result<StepResult> ref = model_forward_backward(c, *be, w, global, StepOptions{}, ref_g);
  EXPECT_TRUE(ref.ok()) << ref.status().to_string();
  if (!ref.ok()) return true;

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  EXPECT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, S, lo);
  EXPECT_TRUE(made.ok()) << made.status().to_string();
  if (!made.ok()) return true;
  ShardedModel& model = **made;
  model.init_weights(kInit);
  std::vector<ParamRef> params = model.parameters();
  for (ParamRef& p : params) {
    const bool router = p.name.find(".gate.weight") != std::string::npos;
    if (k.zero_router && router) p.param.zero();
  }
  if (k.swap_experts) {
    // Expert e0 and e0 + 1 of this rank (its first two) trade their weights.
    LlamaWeights all = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
    EXPECT_TRUE(model.assemble_weights(all).ok());
    for (auto& l : all.layers)
      if (l.moe.defined())
        for (size_t e = 0; e + 1 < l.moe.experts.size(); e += 2) std::swap(l.moe.experts[e], l.moe.experts[e + 1]);
    // Back into this rank's tensors by name.
    for (ParamRef& p : params)
      for (const GlobalSlice& s : p.slices)
        all.for_each([&](const std::string& name, Tensor& t) {
          if (name != s.tensor || name.find(".experts.") == std::string::npos) return;
          for (int64_t r = 0; r < s.rows; ++r)
            for (int64_t col = 0; col < s.cols; ++col)
              p.param.data<float>()[s.offset + r * s.cols + col] = t.data<float>()[(s.row0 + r) * t.dim(-1) + s.col0 + col];
        });
  }
  model.zero_grads(*be);
  const int64_t rows = B / lo.dp, r0 = (lo.dp > 1 ? mesh->coord("dp") : 0) * rows;
  const Batch replica{global.input_ids.narrow(r0, r0 + rows), global.target_ids.narrow(r0, r0 + rows)};
  const Batch local = model.local_batch(replica);
  const int64_t normalizer = be->count_valid_targets(global.target_ids, kIgnoreIndex);
  Result<StepResult> got = model.forward_backward(*be, local, normalizer);
  EXPECT_TRUE(got.ok()) << got.status().to_string();
  if (!got.ok()) return true;
  // The trainer's sum: the routed experts over the replicas holding them (ep over dp).
  sum_grads_over_data_axis(mesh->has_axis("dp") ? &mesh->comm("dp") : nullptr, params,
                           k.experts_over_whole_dp ? nullptr : model.expert_data_axis());

  // The trainer's loss: loss_sum summed over every rank, once per model replica's ranks.
  auto global_loss = [&](double loss_sum) {
    double sum = loss_sum;
    FP_CHECK_OK(world.all_reduce(&sum, &sum, 1, DType::kF64, ReduceOp::kSum));
    return sum / lo.model_ranks() / static_cast<double>(normalizer);
  };
  if (k.swap_experts) {
    // An off-by-one expert must fail the comparison this test makes.
    EXPECT_GT(std::abs(global_loss(got->loss_sum) - ref->loss), 10 * tol::kF32Parallel * ref->loss);
    return true;
  }
  EXPECT_NEAR(global_loss(got->loss_sum), ref->loss, tol::kF32Parallel * ref->loss);
  EXPECT_NEAR(got->aux_loss, ref->aux_loss, tol::kF32Parallel * ref->aux_loss);
  EXPECT_EQ(got->expert_load, ref->expert_load);
  if (k.zero_router) {
    int64_t rest = 0;
    for (int64_t e = c.moe.num_experts_per_tok; e < c.moe.num_experts; ++e) rest += ref->expert_load[e];
    EXPECT_EQ(rest, 0);
  }

  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  EXPECT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<std::pair<std::string, Tensor>> ref_list;
  ref_g.for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  if (k.experts_over_whole_dp) {
    test::expect_experts_off(assembled, ref_list);
    return true;
  }
  size_t i = 0, experts = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(name, ref_list[i].first);
    if (name.find(".experts.") != std::string::npos) ++experts;
    EXPECT_LE(max_rel_error(t, ref_list[i].second), tol::kF32Parallel)
        << name << " on rank " << world.rank() << "\n"
        << describe_mismatches(t, ref_list[i].second, tol::kF32Parallel);
    ++i;
  });
  EXPECT_GT(experts, 0u);
  // The weights assemble to the single-rank model's (every expert from its owner).
  LlamaWeights weights = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  EXPECT_TRUE(model.assemble_weights(weights).ok());
  test::expect_weights_exact(weights, w);

  // A forward alone (the trainer's validation): the same loss.
  Result<StepResult> fwd = model.forward(*be, local);
  EXPECT_TRUE(fwd.ok()) << fwd.status().to_string();
  if (fwd.ok()) {
    EXPECT_NEAR(global_loss(fwd->loss_sum), ref->loss, tol::kF32Parallel * ref->loss);
    EXPECT_EQ(fwd->expert_load, ref->expert_load);
  }
  return true;
}

// Every layout below whose ranks are the world's; at least one must run.
void check_all(const std::vector<Case>& cases) {
  int ran = 0;
  for (const Case& k : cases) ran += check(k) ? 1 : 0;
  if (ran == 0) GTEST_SKIP() << "no layout of " << test::mpi().world().size() << " ranks here";
}

std::vector<Case> layouts(MoeFamily f) {
  return {{"tp=2", f},          {"tp=2:seqpar", f},      {"sp=2", f},
          {"tp=2,sp=2", f},     {"tp=2,sp=2:seqpar", f}, {"tp=4", f},
          {"tp=4:seqpar", f},   {"sp=4", f},             {"dp=2,tp=2", f},
          {"dp=2,tp=2:seqpar", f}, {"dp=2,sp=2", f}};
}

TEST(MegatronMoeParity, Mixtral) { check_all(layouts(MoeFamily::kMixtral)); }
TEST(MegatronMoeParity, Qwen2SharedExpertAndDenseLayer) { check_all(layouts(MoeFamily::kQwen2)); }
TEST(MegatronMoeParity, Qwen3SparseStepPerLayerAux) {
  check_all({{"tp=2:seqpar", MoeFamily::kQwen3}, {"sp=2", MoeFamily::kQwen3}, {"tp=2,sp=2", MoeFamily::kQwen3}});
}
TEST(MegatronMoeParity, RanksWithNoTokensForTheirExperts) {
  check_all({{"tp=2", MoeFamily::kMixtral, true},
             {"sp=2", MoeFamily::kQwen2, true},
             {"tp=2,sp=2", MoeFamily::kMixtral, true},
             {"dp=2,tp=2:seqpar", MoeFamily::kQwen2, true}});
}
// Recompute::kBlock: the sparse layer's forward runs again in backward, its dispatch with it.
TEST(MegatronMoeParity, RecomputeBlocks) {
  check_all({{"tp=2:recompute", MoeFamily::kQwen2}, {"sp=2:recompute", MoeFamily::kMixtral},
             {"tp=2,sp=2:seqpar:recompute", MoeFamily::kQwen2}, {"tp=4:recompute", MoeFamily::kMixtral}});
}
// moe_capacity_factor 0.5: each expert takes 4 of a sequence's 32 pairs (Mixtral) or, with
// Qwen2's k = 2 and factor 0.75, 6; which go depends on every rank's rows of the sequence
// (its sp shard, its tp block), exchanged over the expert axis.
TEST(MegatronMoeParity, CapacityDropsAsTheSingleRankModel) {
  std::vector<Case> cases;
  for (Case k : layouts(MoeFamily::kMixtral)) {
    k.capacity_factor = 0.5;
    cases.push_back(k);
  }
  for (const char* l : {"tp=2:seqpar", "sp=2", "tp=2,sp=2", "sp=2:ring"}) {
    Case q{l, MoeFamily::kQwen2};
    q.capacity_factor = 0.75;
    cases.push_back(q);
  }
  Case split{"tp=2,sp=2", MoeFamily::kMixtral, false, 2, 1};  // experts split over ranks
  split.capacity_factor = 0.5;
  cases.push_back(split);
  check_all(cases);
}
// T Q > E: each expert's f_e split over T Q / E ranks (ShardDims::expert_group).
TEST(MegatronMoeParity, MoreRanksThanExperts) {
  check_all({{"tp=2", MoeFamily::kMixtral, false, 1, 1},
             {"sp=2", MoeFamily::kQwen2, false, 1, 1},
             {"tp=2,sp=2", MoeFamily::kMixtral, false, 2, 1},
             {"tp=2,sp=2:seqpar", MoeFamily::kQwen2, false, 2, 2},
             {"tp=4", MoeFamily::kMixtral, true, 2, 1},
             {"dp=2,sp=2", MoeFamily::kMixtral, false, 1, 1}});
}
// Expert parallelism over dp (Layout::ep = K tp sp): each expert group spans K = 2 dp
// replicas, one whole expert per rank (E = 4 at 4 ranks).
std::vector<Case> expert_data_layouts(MoeFamily f) {
  return {{"dp=2,tp=2,ep=4", f}, {"dp=2,tp=2,ep=4:seqpar", f}, {"dp=2,sp=2,ep=4", f}};
}
TEST(MegatronMoeParity, ExpertsOverDataParallelReplicas) {
  check_all(expert_data_layouts(MoeFamily::kMixtral));
  check_all(expert_data_layouts(MoeFamily::kQwen2));
  check_all({{"dp=2,tp=2,ep=4:recompute", MoeFamily::kQwen3}, {"dp=2,sp=2,ep=4", MoeFamily::kMixtral, true}});
}
TEST(MegatronMoeParity, NegativeControlExpertGradientsOverTheWholeDataAxis) {
  Case tp{"dp=2,tp=2,ep=4", MoeFamily::kMixtral};
  tp.experts_over_whole_dp = true;
  Case sp{"dp=2,sp=2,ep=4", MoeFamily::kQwen2};
  sp.experts_over_whole_dp = true;
  check_all({tp, sp});
}

TEST(MegatronMoeParity, NegativeControlSwappedExperts) {
  // Two experts per rank at two ranks (E = 4).
  Case tp{"tp=2", MoeFamily::kMixtral};
  tp.swap_experts = true;
  Case sp{"sp=2:contiguous", MoeFamily::kMixtral};
  sp.swap_experts = true;
  check_all({tp, sp});
}

// The dispatch's bytes for a known routing: with a zero router every token picks experts
// 0 .. k-1 (ties to the lower index), so what each rank sends is known exactly. Forward only,
// on the layouts whose expert axis is the tp or the sp communicator itself (tp=2, tp=2:seqpar,
// sp=2 at two ranks; tp=4, sp=4 at four). T: this rank's own rows, B S / D on every one of
// them (plain tp: its block of the replicated rows). Per sparse layer: one all_to_all of the
// El counts per peer, and point-to-point the T rows of each chosen expert to its owner and,
// on the owner, the D-1 other ranks' T rows back (docs/composition.md, "Expert parallelism on
// the Megatron baselines"). Plain tp adds one all_gather over tp of the T output rows.
void check_counted_traffic(const char* text) {
  Communicator& world = test::mpi().world();
  const Layout lo = parse_layout(text).value();
  if (lo.ranks() != world.size()) return;
  SCOPED_TRACE(text);
  LlamaConfig c = moe_config(MoeFamily::kMixtral);
  const int D = world.size(), E = 4, k = 2, El = E / D;
  const int64_t B = 2, S = 16, T = B * S / D, h = c.hidden_size;
  const int64_t sparse = c.moe.sparse_layer_count(c.num_hidden_layers);
  const Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Communicator& axis = mesh->comm(lo.tp > 1 ? "tp" : "sp");
  const int p = axis.rank();
  auto run = [&](const LlamaConfig& config) {
    Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(config, *mesh, S, lo);
    FP_CHECK(made.ok(), "{}", made.status().to_string());
    (*made)->init_weights(kInit);
    for (ParamRef& r : (*made)->parameters())
      if (r.name.find(".gate.weight") != std::string::npos) r.param.zero();
    const CommStats before = axis.stats();
    Result<StepResult> r = (*made)->forward(*be, (*made)->local_batch(global));
    FP_CHECK(r.ok(), "{}", r.status().to_string());
    return axis.stats() - before;
  };
  const CommStats moe = run(c);
  LlamaConfig dense = c;
  dense.moe = MoeConfig();
  const CommStats mlp = run(dense);
  auto holds = [&](int64_t e) { return e / El == p; };
  int64_t rows_out = 0;
  for (int64_t e = 0; e < k; ++e) rows_out += holds(e) ? (D - 1) * T : T;
  EXPECT_EQ(moe.op(CommOpKind::kSend).bytes_sent, static_cast<uint64_t>(sparse * rows_out * h * 4));
  EXPECT_EQ(moe.op(CommOpKind::kAllToAll).calls, static_cast<uint64_t>(sparse));
  EXPECT_EQ(moe.op(CommOpKind::kAllToAll).bytes_sent, static_cast<uint64_t>(sparse * (D - 1) * El * 8));
  EXPECT_EQ(mlp.op(CommOpKind::kSend).bytes_sent, 0u);
  if (lo.tp > 1 && !lo.sequence_parallel) {
    // The dense MLP's g: all_reduce of [N, h] per layer; the MoE layer's all_gather of the
    // rank's T rows instead (the rest, attention and the head, is the same in both runs).
    EXPECT_EQ(moe.op(CommOpKind::kAllGather).bytes_sent - mlp.op(CommOpKind::kAllGather).bytes_sent,
              static_cast<uint64_t>(sparse * (D - 1) * T * h * 4));
    // ... less the one all_reduce of the routing statistics over the expert axis (tp here).
    EXPECT_EQ(mlp.op(CommOpKind::kAllReduce).calls - moe.op(CommOpKind::kAllReduce).calls,
              static_cast<uint64_t>(sparse - 1));
  }
  if (lo.sequence_parallel) {
    // No gather of a2 and no reduce-scatter of the output: the rows stay the rank's own.
    EXPECT_EQ(mlp.op(CommOpKind::kAllGather).calls - moe.op(CommOpKind::kAllGather).calls,
              static_cast<uint64_t>(sparse));
    EXPECT_EQ(mlp.op(CommOpKind::kReduceScatter).calls - moe.op(CommOpKind::kReduceScatter).calls,
              static_cast<uint64_t>(sparse));
  }
}

TEST(MegatronMoeTraffic, DispatchBytesForACountedRouting) {
  for (const char* text : {"tp=2", "tp=2:seqpar", "sp=2", "tp=4", "tp=4:seqpar", "sp=4"}) check_counted_traffic(text);
}

// Gradient accumulation: four micro-batches of one sequence each, every one its own aux loss
// weighted by its share v_m / N of the step's valid targets (docs/design.md, "Mixture of
// experts"), against the single-rank model micro-batch by micro-batch (tsp_moe_parity_test's
// rule): the loss and every gradient.
void check_accumulation(const char* text, MoeFamily family) {
  Communicator& world = test::mpi().world();
  const Layout lo = parse_layout(text).value();
  if (lo.ranks() != world.size()) return;
  SCOPED_TRACE(text);
  const LlamaConfig c = moe_config(family);
  const int64_t B = 4, S = 16;
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  const int64_t N = be->count_valid_targets(global.target_ids, kIgnoreIndex);
  std::vector<Batch> parts;
  for (int64_t m = 0; m < B; ++m)
    parts.push_back(Batch{global.input_ids.narrow(m, m + 1), global.target_ids.narrow(m, m + 1)});
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  std::vector<Tensor> sum;
  ref_g.for_each([&](const std::string&, Tensor& t) { sum.push_back(t); });
  double ref_loss = 0;
  for (const Batch& part : parts) {
    LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
    g.zero();
    Result<StepResult> r = model_forward_backward(c, *be, w, part, StepOptions{}, g);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const double share = static_cast<double>(r->valid_tokens) / static_cast<double>(N);
    ref_loss += share * r->loss;
    size_t i = 0;
    g.for_each([&](const std::string&, Tensor& t) {
      for (int64_t j = 0; j < t.numel(); ++j)
        sum[i].data<float>()[j] += static_cast<float>(share * static_cast<double>(t.data<float>()[j]));
      ++i;
    });
  }
  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, S, lo);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ShardedModel& model = **made;
  model.init_weights(kInit);
  model.zero_grads(*be);
  std::vector<Batch> locals;
  for (const Batch& part : parts) locals.push_back(model.local_batch(part));
  Result<StepResult> got = model.forward_backward_micro_batches(*be, locals, N);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_NEAR(got->loss_sum / static_cast<double>(N), ref_loss, tol::kF32Parallel * ref_loss);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<std::pair<std::string, Tensor>> ref_list;
  ref_g.for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(name, ref_list[i].first);
    EXPECT_LE(max_rel_error(t, ref_list[i].second), tol::kF32Parallel)
        << name << " on rank " << world.rank() << "\n"
        << describe_mismatches(t, ref_list[i].second, tol::kF32Parallel);
    ++i;
  });
}

TEST(MegatronMoeAccumulation, EachMicroBatchItsOwnAuxLossWeightedByItsValidTargets) {
  for (const char* text : {"tp=2", "sp=2", "tp=2:seqpar", "tp=2,sp=2", "tp=2,sp=2:seqpar"}) {
    check_accumulation(text, MoeFamily::kMixtral);
    check_accumulation(text, MoeFamily::kQwen2);
  }
}

// ---- bf16 storage: moe_bf16_rules.h's tolerances and routing margin ----
//
// Both sides store weights and activations in bf16 through the bf16 storage decorator; the
// references are the single-rank model in bf16 and in f32. The loss within 1 bf16 ulp, the
// gradients within 16 (the router's 32), as moe_bf16_rules.h derives them; the weights
// give every routing choice a margin far above bf16's noise (moe_margin_weights: coordinate
// 0 of the residual stream held at 0.5, router column 0 ordering the experts), so the routing
// and the per-expert load are the references'.
using test::kBf16LossTol;
using test::kBf16RouterTol;
using test::kBf16TensorTol;

void check_bf16(const char* text, MoeFamily family) {
  Communicator& world = test::mpi().world();
  const Layout lo = parse_layout(text).value();
  if (lo.ranks() != world.size()) return;
  SCOPED_TRACE(text);
  const LlamaConfig c = moe_config(family);
  const int64_t B = 4, S = 16;
  const Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  LlamaWeights w32 = test::moe_margin_weights(c, kInit);
  const LlamaWeights w16 = test::converted_weights(c, w32, DType::kBF16);
  auto single = [&](const LlamaWeights& w, Backend& be, LlamaWeights& g) {
    g.zero();
    return model_forward_backward(c, be, w, global, StepOptions{}, g);
  };
  LlamaWeights want_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  LlamaWeights f32_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  Result<StepResult> want = single(w16, *bf, want_g), f32 = single(w32, *cpu, f32_g);
  ASSERT_TRUE(want.ok() && f32.ok());
  ASSERT_EQ(want->expert_load, f32->expert_load) << "the margin keeps bf16 and f32 routing alike";

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, S, lo);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ShardedModel& model = **made;
  test::load_global(model.parameters(), w32);
  model.zero_grads(*cpu);
  const int64_t rows = B / lo.dp, r0 = (lo.dp > 1 ? mesh->coord("dp") : 0) * rows;
  const Batch replica{global.input_ids.narrow(r0, r0 + rows), global.target_ids.narrow(r0, r0 + rows)};
  const int64_t normalizer = cpu->count_valid_targets(global.target_ids, kIgnoreIndex);
  Result<StepResult> got = model.forward_backward(*bf, model.local_batch(replica), normalizer);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  std::vector<ParamRef> params = model.parameters();
  sum_grads_over_data_axis(mesh->has_axis("dp") ? &mesh->comm("dp") : nullptr, params, model.expert_data_axis());
  EXPECT_EQ(got->expert_load, want->expert_load);
  double sum = got->loss_sum;
  FP_CHECK_OK(world.all_reduce(&sum, &sum, 1, DType::kF64, ReduceOp::kSum));
  const double loss = sum / lo.model_ranks() / static_cast<double>(normalizer);
  for (const StepResult* ref : {&*want, &*f32}) {
    EXPECT_NEAR(loss, ref->loss, kBf16LossTol * ref->loss);
    EXPECT_NEAR(got->aux_loss, ref->aux_loss, kBf16LossTol * ref->aux_loss);
  }
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<Tensor> wg, fg;
  want_g.for_each([&](const std::string&, Tensor& t) { wg.push_back(t); });
  f32_g.for_each([&](const std::string&, Tensor& t) { fg.push_back(t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    const double tol = name.ends_with(".gate.weight") ? kBf16RouterTol : kBf16TensorTol;
    EXPECT_LE(max_rel_error(t, wg[i]), tol) << name << " against bf16\n" << describe_mismatches(t, wg[i], tol);
    EXPECT_LE(max_rel_error(t, fg[i]), tol) << name << " against f32\n" << describe_mismatches(t, fg[i], tol);
    ++i;
  });
}

TEST(MegatronMoeBf16Parity, AgainstTheSingleRankModelInBf16AndF32) {
  for (const char* text : {"tp=2:bf16", "tp=2:seqpar:bf16", "sp=2:bf16", "tp=2,sp=2:bf16", "dp=2,tp=2:seqpar:bf16",
                           "dp=2,sp=2,ep=4:bf16"}) {
    check_bf16(text, MoeFamily::kMixtral);
    check_bf16(text, MoeFamily::kQwen2);
  }
}

}  // namespace
}  // namespace foldpar
