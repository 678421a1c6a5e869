// The pipeline (pp=P over TSP or tp stages, parallel/pipeline/) against the single-rank model, its
// reference: every rank builds the global weights and the batch of m micro-batches from one
// seed, computes the single-rank loss and gradients of the whole batch (the mean over its
// valid tokens), runs the layout through the factory as training does (m micro-batches in one
// 1F1B schedule, the global-batch normalizer) and compares the loss, every assembled gradient
// and every ParamRef's place; the tied embedding's two copies agree bit for bit; the
// boundary's traffic is exactly 2*m*B*(S/D)*h*beta per boundary; the refusals name their
// numbers. Layouts by world size W: pp=2,tsp=1 and pp=2,tp=1 (W = 2); pp=2,tsp=2, pp=4,tsp=1,
// pp=2,dp=2,tsp=1, pp=2,tp=2, pp=2,tp=2:seqpar and pp=2,sp=2 (W = 4); pp=2,dp=2,tsp=2 (W = 8);
// the interleaved schedule (v chunks per rank, `:interleaved=V`) at pp=2 x tsp=1 and 2 and pp=4;
// ZB-H1 (`:zb`) on tsp=1, tsp=2 and 4 and Megatron stages, KV replicas included.
// The attention variants and KV replicas (issue 21) on stages and under dp, where dp runs
// also without a pp axis (dp=K around tsp, tp, sp and tp x sp: the same harness, the trainer's
// data-parallel sum of every ParamRef, no pipeline traffic to check).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "core/tolerance.h"
#include "mpi_test_main.h"
#include "param_ref_check.h"
#include "parallel/make_layout.h"
#include "parallel/pipeline/pipeline_model.h"
#include "tensor/compare.h"
#include "train/trainer.h"

namespace foldpar {
namespace {

// n_h 8, n_kv 4 (g = 2), f and V divisible by 2; S = 32 splits in zigzag for D <= 2.
LlamaConfig test_config(int layers, bool tied) {
  LlamaConfig c;
  c.hidden_size = 64;  // d = 8
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.intermediate_size = 96;
  c.vocab_size = 80;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// The Hugging Face attention variants (model/llama_config.h): none, Qwen2's q/k/v biases,
// Llama's attention_bias (q/k/v and o biases), Qwen3's per-head q/k RMSNorm; Llama's
// mlp_bias (gate/up/down biases) alone and with attention_bias.
enum class Variant { kNone, kQwen2, kAttentionBias, kQwen3, kMlpBias, kAllBiases };

struct Case {
  std::string layout{};     // run where its ranks equal the world size
  int layers = 4;
  bool tied = false;
  int m_per_stage = 1;      // m = this x p micro-batches
  int64_t batch = 1;        // B per micro-batch
  int64_t seq = 32;
  Recompute recompute = Recompute::kNone;
  std::vector<int> stages{};  // --stage-layers; empty: balanced
  int chunks = 1;             // v: interleaved 1F1B over v chunks per rank when > 1
  Variant variant = Variant::kNone;
  int64_t kv_heads = 0;       // > 0: num_key_value_heads (below the weight degree: KV replicas)
};

LlamaConfig case_config(const Case& k) {
  LlamaConfig c = test_config(k.layers, k.tied);
  const bool all = k.variant == Variant::kAllBiases;
  c.qkv_bias = k.variant == Variant::kQwen2 || k.variant == Variant::kAttentionBias || all;
  c.o_bias = k.variant == Variant::kAttentionBias || all;
  c.qk_norm = k.variant == Variant::kQwen3;
  c.mlp_bias = k.variant == Variant::kMlpBias || all;
  if (k.kv_heads > 0) c.num_key_value_heads = k.kv_heads;
  return c;
}

// Weights with std 0.1 so that attention is far from uniform and every path matters.
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

Batch rows(const Batch& global, int64_t b0, int64_t b1) {
  return Batch{global.input_ids.narrow(b0, b1), global.target_ids.narrow(b0, b1)};
}

// KV replicas (n_kv below the weight degree W): after the data-parallel sum the G = W / n_kv
// members of each KV group hold bit-identical wk/wv gradients (ParamRef "layers.l.attn_kv"),
// so identical AdamW updates keep the replicas identical. Collective over the weight axis.
void expect_replicas_identical(Mesh& mesh, const Layout& lo, const LlamaConfig& c, const std::vector<ParamRef>& params) {
  const int W = lo.weight_degree();
  if (c.num_key_value_heads >= W) return;
  Communicator& axis = mesh.comm(lo.strategy == Strategy::kTsp ? "tsp" : "tp");
  const int G = W / static_cast<int>(c.num_key_value_heads), first = axis.rank() / G * G;
  int checked = 0;
  for (const ParamRef& p : params) {
    if (!p.name.ends_with(".attn_kv")) continue;
    ++checked;
    const int64_t n = p.grad.numel();
    Tensor all = Tensor::empty({W, n}, DType::kF32, MemCategory::kWorkspace);
    FP_CHECK_OK(axis.all_gather(p.grad.raw_data(), all.raw_data(), static_cast<size_t>(n), DType::kF32));
    EXPECT_EQ(max_rel_error(all.narrow(axis.rank(), axis.rank() + 1), all.narrow(first, first + 1)), 0.0)
        << p.name << " under " << lo.to_string() << ": weight rank " << axis.rank() << "'s replica differs from "
        << first << "'s";
  }
  EXPECT_GT(checked, 0) << "no KV replica ParamRef under " << lo.to_string();
}

// Runs a case if the world has its ranks; false (skipped) otherwise.
bool check_parity(const Case& k) {
  Communicator& world = test::mpi().world();
  Layout lo = parse_layout(k.layout).value();
  if (lo.ranks() != world.size()) return false;
  lo.recompute = k.recompute;
  lo.stage_layers = k.stages;
  lo.chunks = k.chunks;
  const LlamaConfig c = case_config(k);
  const int m = k.m_per_stage * lo.pp;
  const int64_t global_rows = m * k.batch * lo.dp;

  // The reference: the single-rank model over the whole global batch.
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const Batch global = synthetic_batch(c, global_rows, k.seq, 11, 0.1);
  auto be = make_cpu_backend();
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  Result<StepResult> ref = model_forward_backward(c, *be, w, global, StepOptions{}, ref_g);
  FP_CHECK_OK(ref.status());

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  FP_CHECK_OK(mesh.status());
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, k.seq, lo);
  FP_CHECK_OK(made.status());
  ShardedModel& model = **made;
  model.init_weights(kInit);
  model.zero_grads(*be);
  const int d = mesh->coord("dp");
  std::vector<Batch> locals;
  for (int i = 0; i < m; ++i) {
    const int64_t b0 = (d * m + i) * k.batch;
    locals.push_back(model.local_batch(rows(global, b0, b0 + k.batch)));
  }
  const int64_t normalizer = ref->valid_tokens;
  // (Without a pp axis, dp over a model axis: the traffic checks below are the pipeline's.)
  ScopedCommCounter counter(lo.pp > 1 ? std::vector<const Communicator*>{&mesh->comm("pp")}
                                      : std::vector<const Communicator*>{});
  Result<StepResult> got = model.forward_backward_micro_batches(*be, locals, normalizer);
  FP_CHECK_OK(got.status());
  const CommStats pp_traffic = counter.delta();

  // Loss: this replica's rows; with dp the replicas' sums add up to the reference's.
  double sums[2] = {got->loss_sum, static_cast<double>(got->valid_tokens)};
  if (lo.dp > 1) FP_CHECK_OK(mesh->comm("dp").all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum));
  EXPECT_EQ(static_cast<int64_t>(sums[1]), ref->valid_tokens);
  EXPECT_NEAR(sums[0] / sums[1], ref->loss, tol::kF32Parallel * ref->loss) << k.layout;

  // Gradients: summed over dp by the trainer's own sum, then assembled over tsp and pp.
  std::vector<ParamRef> params = model.parameters();
  sum_grads_over_data_axis(lo.dp > 1 ? &mesh->comm("dp") : nullptr, params);
  expect_replicas_identical(*mesh, lo, c, params);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  FP_CHECK_OK(model.assemble_grads(assembled));
  std::vector<Tensor> ref_list;
  ref_g.for_each([&](const std::string&, Tensor& t) { ref_list.push_back(t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    const Tensor& r = ref_list[i++];
    EXPECT_LE(max_rel_error(t, r), tol::kF32Parallel)
        << name << " under " << lo.to_string() << " on rank " << world.rank() << "\n"
        << describe_mismatches(t, r, tol::kF32Parallel);
  });
  // The assembled weights are the single-rank model's, bit for bit.
  LlamaWeights weights = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  FP_CHECK_OK(model.assemble_weights(weights));
  std::vector<Tensor> w_list;
  w.for_each([&](const std::string&, Tensor& t) { w_list.push_back(t); });
  i = 0;
  weights.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, w_list[i++]), 0.0) << name; });

  // Every ParamRef's slices on every rank (replicated gains and attention variants, KV
  // replicas, the tied embedding's two copies) against the reference's blocks; every global
  // element is counted by exactly one rank of a replica: counted ParamRef elements over the
  // world equal the model's times dp.
  double counted = static_cast<double>(test::expect_param_refs(params, w, ref_g, lo.to_string()));
  FP_CHECK_OK(world.all_reduce(&counted, &counted, 1, DType::kF64, ReduceOp::kSum));
  double total = 0;
  w.for_each([&](const std::string&, Tensor& t) { total += static_cast<double>(t.numel()); });
  EXPECT_EQ(counted, total * lo.dp);

  // Tied: the end stages' embedding gradients are equal bit for bit (exchanged over pp).
  if (lo.pp == 1) return true;
  const int s = mesh->coord("pp"), P = lo.pp;
  if (k.tied && (s == 0 || s == P - 1)) {
    Tensor* g = nullptr;
    for (ParamRef& p : params)
      if (p.name == "embed") g = &p.grad;
    FP_CHECK(g != nullptr, "no embedding on an end stage");
    Tensor other = Tensor::empty(g->shape(), DType::kF32, MemCategory::kWorkspace);
    const int peer = s == 0 ? P - 1 : 0;
    FP_CHECK_OK(mesh->comm("pp").send_recv(g->raw_data(), other.raw_data(), static_cast<size_t>(g->numel()), DType::kF32,
                                           peer, peer));
    EXPECT_EQ(max_rel_error(*g, other), 0.0) << "tied embedding gradients of stages 0 and " << P - 1;
  }

  // Traffic on pp, exactly: each boundary between chunks moves m activations forward and m
  // gradients back, [B*S/D, h] f32 each (v chunks per rank: rank s sends for each of its
  // chunks g = c P + s but the model's last its output, and for each but chunk 0 its input
  // gradient); the tied embedding's exchange adds V/D*h*4 each way on the end stages; the
  // loss's broadcast two f64.
  const int64_t local_rows = locals[0].input_ids.numel();  // B*S/D (tsp); B*S, or B*S/tp with seqpar (tp)
  const uint64_t msg = static_cast<uint64_t>(local_rows * c.hidden_size * 4);
  uint64_t sends = 0;
  for (int ch = 0; ch < lo.chunks; ++ch) {
    const int g = ch * P + s;
    sends += static_cast<uint64_t>((g < P * lo.chunks - 1 ? m : 0) + (g > 0 ? m : 0));
  }
  EXPECT_EQ(pp_traffic.op(CommOpKind::kSend).bytes_sent, sends * msg) << lo.to_string() << " stage " << s;
  EXPECT_EQ(pp_traffic.op(CommOpKind::kSend).calls, sends);
  EXPECT_EQ(pp_traffic.op(CommOpKind::kRecv).bytes_received, sends * msg);
  const uint64_t tied_bytes =
      k.tied && (s == 0 || s == P - 1) ? c.vocab_size / lo.weight_degree() * c.hidden_size * 4 : 0;
  EXPECT_EQ(pp_traffic.op(CommOpKind::kSendRecv).bytes_sent, tied_bytes);
  EXPECT_EQ(pp_traffic.op(CommOpKind::kBroadcast).calls, 1u);
  // Per boundary, over its two stages: 2*m*B*(S/D)*h*beta (summed over the world: each of the
  // P v - 1 chunk boundaries of every replica and TSP index).
  double sent = static_cast<double>(pp_traffic.op(CommOpKind::kSend).bytes_sent);
  FP_CHECK_OK(world.all_reduce(&sent, &sent, 1, DType::kF64, ReduceOp::kSum));
  EXPECT_EQ(sent, 2.0 * m * local_rows * c.hidden_size * 4 * (P * lo.chunks - 1) * lo.model_ranks() / P * lo.dp);
  return true;
}

#define RUN_OR_SKIP(...)                                                   \
  do {                                                                     \
    bool ran = false;                                                      \
    for (const Case& k : std::vector<Case>{__VA_ARGS__}) ran = check_parity(k) || ran; \
    if (!ran) GTEST_SKIP() << "no case for " << test::mpi().world().size() << " ranks"; \
  } while (0)

TEST(PipelineParity, OneMicroBatchPerStage) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1"}, Case{.layout = "pp=2,tsp=2"}, Case{.layout = "pp=4,tsp=1"});
}

TEST(PipelineParity, TwoMicroBatchesPerStage) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .m_per_stage = 2}, Case{.layout = "pp=2,tsp=2", .m_per_stage = 2},
              Case{.layout = "pp=4,tsp=1", .m_per_stage = 2});
}

TEST(PipelineParity, TiedEmbeddings) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=4,tsp=1", .tied = true});
}

TEST(PipelineParity, UnevenStages) {
  // Balanced by matmul FLOPs with the head on the last stage (L = 5, p = 2: 3 + 2; p = 4:
  // 1,1,2,1) and explicit lists.
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .layers = 5}, Case{.layout = "pp=2,tsp=1", .layers = 3, .stages = {2, 1}},
              Case{.layout = "pp=2,tsp=2", .layers = 3, .tied = true, .stages = {1, 2}},
              Case{.layout = "pp=4,tsp=1", .layers = 5, .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=4,tsp=1", .layers = 6, .stages = {1, 2, 2, 1}});
}

// Interleaved 1F1B (v chunks per rank, chunk g on rank g % P): m = P and m = 2P, tsp = 1
// and 2, tied and untied, uneven chunks (L = 5 over 4), block recomputation and v = 3.
TEST(PipelineParity, InterleavedChunks) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .chunks = 2},
              Case{.layout = "pp=2,tsp=1", .layers = 5, .tied = true, .m_per_stage = 2, .chunks = 2},
              Case{.layout = "pp=2,tsp=1", .layers = 6, .m_per_stage = 2, .recompute = Recompute::kBlock, .chunks = 3},
              Case{.layout = "pp=2,tsp=2", .tied = true, .chunks = 2},
              Case{.layout = "pp=2,tsp=2", .m_per_stage = 2, .chunks = 2},
              Case{.layout = "pp=4,tsp=1", .layers = 8, .tied = true, .chunks = 2});
}

// ZB-H1 (`:zb`): each backward's weight-gradient products deferred and run as the schedule's
// W ops. tsp=1 stages at pp = 2 and 4, m = p and m = 2p, tied and untied, uneven stages,
// block recomputation, the attention variants (their bias and norm gradients stay in B), dp
// around the pipeline, and the Megatron stages (tp with and without seqpar, sp).
TEST(PipelineParity, ZeroBubble) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1:zb"}, Case{.layout = "pp=2,tsp=1:zb", .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=1:zb", .tied = true}, Case{.layout = "pp=2,tsp=1:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=1:zb", .layers = 5, .m_per_stage = 2, .batch = 2},
              Case{.layout = "pp=2,tsp=1:zb", .m_per_stage = 2, .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,tsp=1:zb", .tied = true, .m_per_stage = 2, .variant = Variant::kAttentionBias},
              Case{.layout = "pp=2,tsp=1:zb", .m_per_stage = 2, .variant = Variant::kQwen3},
              Case{.layout = "pp=4,tsp=1:zb"}, Case{.layout = "pp=4,tsp=1:zb", .m_per_stage = 2},
              Case{.layout = "pp=4,tsp=1:zb", .tied = true}, Case{.layout = "pp=4,tsp=1:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=4,tsp=1:zb", .layers = 6, .m_per_stage = 2, .stages = {1, 2, 2, 1},
                   .variant = Variant::kQwen2},
              Case{.layout = "pp=2,dp=2,tsp=1:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tp=2:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tp=2:seqpar:zb", .layers = 3, .m_per_stage = 2, .variant = Variant::kAttentionBias},
              Case{.layout = "pp=2,sp=2:zb", .m_per_stage = 2, .variant = Variant::kQwen3},
              Case{.layout = "pp=4,dp=2,tsp=1:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tp=2,sp=2:zb", .m_per_stage = 2});
}

// ZB-H1 on tsp=D stages: B runs the input gradient with the weight shards moving as today,
// W the queued weight products with the reduces to each shard's owner and the MLP's gradient
// ring behind them (TspStep::set_weight_grads). pp=2,tsp=2 at m = p and 2p, tied and untied,
// uneven stages, B = 2 with recomputation, the attention and MLP biases (their gradients stay
// in B), no overlap with two head buckets, the forward's weights and K/V kept, KV replicas
// (their zeroing and copy run in W);
// with dp, at pp = 4 and at tsp = 4 where the world has 8 ranks.
TEST(PipelineParity, ZeroBubbleOnTspStages) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=2:zb"}, Case{.layout = "pp=2,tsp=2:zb", .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2:zb", .tied = true},
              Case{.layout = "pp=2,tsp=2:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2:zb", .layers = 3, .tied = true, .m_per_stage = 2, .stages = {1, 2}},
              Case{.layout = "pp=2,tsp=2:zb", .m_per_stage = 2, .batch = 2, .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,tsp=2:zb", .tied = true, .m_per_stage = 2, .variant = Variant::kAllBiases},
              Case{.layout = "pp=2,tsp=2:nooverlap:buckets=2:zb", .m_per_stage = 2, .variant = Variant::kQwen3},
              Case{.layout = "pp=2,tsp=2:keepw:keepkv:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tsp=2:zb", .m_per_stage = 2, .variant = Variant::kQwen2, .kv_heads = 1},
              Case{.layout = "pp=2,dp=2,tsp=2:zb", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=4,tsp=2:zb", .layers = 5, .m_per_stage = 2, .stages = {2, 1, 1, 1}},
              Case{.layout = "pp=2,tsp=4:zb", .tied = true, .m_per_stage = 2, .kv_heads = 2});
}

// ZB-H1 with KV replicas on Megatron stages (n_kv < tp): the wk/wv gradients' sum over the
// KV group is queued behind their products and runs in W.
TEST(PipelineParity, ZeroBubbleWithKvReplicasOnMegatronStages) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tp=2:zb", .tied = true, .m_per_stage = 2, .variant = Variant::kQwen2, .kv_heads = 1},
              Case{.layout = "pp=2,tp=2:seqpar:zb", .variant = Variant::kAttentionBias, .kv_heads = 1},
              Case{.layout = "pp=2,tp=2,sp=2:zb", .m_per_stage = 2, .kv_heads = 1},
              Case{.layout = "pp=2,tp=4:zb", .m_per_stage = 2, .variant = Variant::kQwen3, .kv_heads = 1});
}

TEST(PipelineParity, BatchTwoAndRecompute) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .batch = 2, .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,tsp=2", .m_per_stage = 2, .batch = 2, .recompute = Recompute::kBlock});
}

TEST(PipelineParity, MegatronStages) {
  // The baselines under pp: tp=N stages (with and without sequence-parallel norms) and sp=M
  // stages (both K/V exchanges).
  RUN_OR_SKIP(Case{.layout = "pp=2,tp=1", .m_per_stage = 2}, Case{.layout = "pp=2,tp=2", .tied = true, .m_per_stage = 2},
              Case{.layout = "pp=2,tp=2:seqpar", .layers = 3, .m_per_stage = 2},
              Case{.layout = "pp=2,tp=2", .layers = 5, .recompute = Recompute::kBlock},
              Case{.layout = "pp=2,sp=2", .m_per_stage = 2}, Case{.layout = "pp=2,sp=2:ring", .tied = true});
}

TEST(PipelineParity, WithDataParallel) {
  RUN_OR_SKIP(Case{.layout = "pp=2,dp=2,tsp=1", .m_per_stage = 2}, Case{.layout = "pp=2,dp=2,tsp=1", .tied = true},
              Case{.layout = "pp=2,dp=2,tsp=2", .tied = true, .m_per_stage = 2});
}

// The attention variants (replicated: their gradients summed over the model axis by the
// stage, then over dp once, as the trainer sums every ParamRef) with data parallelism alone
// (no pp axis) and with it around pipeline stages; every variant and layout family.
TEST(PipelineParity, AttentionVariantsWithDataParallel) {
  RUN_OR_SKIP(Case{.layout = "dp=2,tsp=1", .m_per_stage = 2, .variant = Variant::kQwen2},
              Case{.layout = "dp=2,tp=1", .tied = true, .variant = Variant::kAttentionBias},
              Case{.layout = "dp=2,tsp=2", .tied = true, .m_per_stage = 2, .variant = Variant::kQwen3},
              Case{.layout = "dp=2,tp=2", .variant = Variant::kAttentionBias},
              Case{.layout = "dp=2,tp=2:seqpar", .m_per_stage = 2, .variant = Variant::kQwen3},
              Case{.layout = "dp=2,sp=2", .variant = Variant::kQwen2},
              Case{.layout = "dp=4,tsp=2", .variant = Variant::kAttentionBias},
              Case{.layout = "dp=2,tp=2,sp=2:ring", .variant = Variant::kQwen3},
              Case{.layout = "pp=2,dp=2,tsp=2", .tied = true, .m_per_stage = 2, .variant = Variant::kAttentionBias});
}

// KV replicas (n_kv below the weight degree): each replica's wk/wv gradient is complete on
// its rank before the dp sum (TSP: copied from the group's last rank; tp: summed over the
// group), so the dp sum of each replica gives the same result (checked bit for bit).
TEST(PipelineParity, KvReplicasWithDataParallel) {
  RUN_OR_SKIP(Case{.layout = "dp=2,tsp=1", .kv_heads = 1},  // MQA on one model rank
              Case{.layout = "dp=2,tsp=2", .m_per_stage = 2, .kv_heads = 1},
              Case{.layout = "dp=2,tp=2", .tied = true, .variant = Variant::kQwen2, .kv_heads = 1},
              Case{.layout = "dp=2,tsp=4", .variant = Variant::kQwen3, .kv_heads = 2},
              Case{.layout = "dp=2,tp=4:seqpar", .m_per_stage = 2, .kv_heads = 1},
              Case{.layout = "dp=4,tsp=2", .tied = true, .kv_heads = 1});
}

// The attention variants on pipeline stages: each stage holds, sums and counts its own
// layers' variants only (TSP sums them over the axis after the last micro-batch, tp after
// each, sp with the stage's flat gradients); 1F1B and interleaved, tied and untied.
TEST(PipelineParity, AttentionVariantsOnStages) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .m_per_stage = 2, .variant = Variant::kQwen2},
              Case{.layout = "pp=2,tsp=1", .layers = 5, .tied = true, .m_per_stage = 2, .chunks = 2,
                   .variant = Variant::kQwen3},
              Case{.layout = "pp=2,tsp=2", .tied = true, .m_per_stage = 2, .variant = Variant::kAttentionBias},
              Case{.layout = "pp=2,tsp=2", .recompute = Recompute::kBlock, .variant = Variant::kQwen3},
              Case{.layout = "pp=2,tp=2", .m_per_stage = 2, .variant = Variant::kAttentionBias},
              Case{.layout = "pp=2,tp=2:seqpar", .layers = 3, .variant = Variant::kQwen3},
              Case{.layout = "pp=2,sp=2", .m_per_stage = 2, .variant = Variant::kQwen2},
              Case{.layout = "pp=2,sp=2:ring", .tied = true, .variant = Variant::kAttentionBias},
              Case{.layout = "pp=4,tsp=1", .layers = 5, .variant = Variant::kAttentionBias},
              Case{.layout = "pp=4,tsp=2", .tied = true, .variant = Variant::kQwen3},
              Case{.layout = "pp=2,tp=2,sp=2", .variant = Variant::kQwen2});
}

// Llama's mlp_bias on pipeline stages and under dp: replicated like the attention variants,
// so each stage holds, sums and counts its own layers' MLP biases, and dp adds each copy once.
TEST(PipelineParity, MlpBiasOnStagesAndWithDataParallel) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=1", .m_per_stage = 2, .variant = Variant::kMlpBias},
              Case{.layout = "dp=2,tp=1", .tied = true, .variant = Variant::kAllBiases},
              Case{.layout = "pp=2,tsp=1:zb", .m_per_stage = 2, .variant = Variant::kAllBiases},
              Case{.layout = "pp=2,tsp=2", .tied = true, .m_per_stage = 2, .variant = Variant::kAllBiases},
              Case{.layout = "pp=2,tp=2:seqpar", .layers = 3, .variant = Variant::kMlpBias},
              Case{.layout = "pp=2,sp=2:ring", .variant = Variant::kAllBiases},
              Case{.layout = "pp=2,tp=2:zb", .m_per_stage = 2, .variant = Variant::kMlpBias},
              Case{.layout = "dp=2,tsp=2", .variant = Variant::kMlpBias},
              Case{.layout = "dp=2,tp=2", .tied = true, .variant = Variant::kAllBiases, .kv_heads = 1},
              Case{.layout = "pp=2,dp=2,tsp=2", .m_per_stage = 2, .variant = Variant::kAllBiases},
              Case{.layout = "pp=2,tp=2,sp=2", .variant = Variant::kMlpBias});
}

// KV replicas on pipeline stages: the group's wk/wv gradient copy (TSP) or sum (tp) runs per
// stage layer, and overwrites (TSP) or adds (tp) once per micro-batch, so accumulation over
// m micro-batches stays exact.
TEST(PipelineParity, KvReplicasOnStages) {
  RUN_OR_SKIP(Case{.layout = "pp=2,tsp=2", .m_per_stage = 2, .kv_heads = 1},
              Case{.layout = "pp=2,tsp=2", .chunks = 2, .variant = Variant::kQwen3, .kv_heads = 1},
              Case{.layout = "pp=2,tp=2", .tied = true, .m_per_stage = 2, .variant = Variant::kQwen2, .kv_heads = 1},
              Case{.layout = "pp=2,tp=2:seqpar", .variant = Variant::kAttentionBias, .kv_heads = 1},
              Case{.layout = "pp=2,tsp=4", .m_per_stage = 2, .kv_heads = 2},
              Case{.layout = "pp=2,tp=4", .variant = Variant::kQwen3, .kv_heads = 1},
              Case{.layout = "pp=2,dp=2,tsp=2", .tied = true, .variant = Variant::kQwen3, .kv_heads = 1});
}

TEST(PipelineErrors, RefusalsNameTheNumbers) {
  const LlamaConfig c = test_config(4, false);
  auto message = [&](const std::string& text, std::vector<int> stages = {}, int layers = 4) {
    Layout lo = parse_layout(text).value();
    lo.stage_layers = stages;
    LlamaConfig cfg = c;
    cfg.num_hidden_layers = layers;
    const Status st = validate_layout(cfg, lo, 0, 32);
    return st.ok() ? std::string("ok") : st.message();
  };
  EXPECT_EQ(message("pp=2,tsp=1"), "ok");
  EXPECT_EQ(message("pp=8,tsp=1", {}, 4), "pp=8,tsp=1: 4 layers cannot fill 8 pipeline stages (at least one layer per stage)");
  EXPECT_EQ(message("pp=2,tsp=1", {3, 2}), "pp=2,tsp=1:stages=3/2: --stage-layers 3,2 sums to 5, the model has 4 layers");
  EXPECT_EQ(message("pp=2,tsp=1", {4}), "pp=2,tsp=1:stages=4: --stage-layers 4 names 1 stages, the layout has pp=2");
  EXPECT_EQ(message("tsp=1", {4}), "tsp=1:stages=4: --stage-layers is the pp axis's (a layout with pp=P)");
  const Status m = validate_micro_batches(parse_layout("pp=4,tsp=2").value(), 3);
  EXPECT_EQ(m.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.message(), "pp=4,tsp=2: 3 micro-batches per step cannot fill 4 pipeline stages (need m >= p; lower "
                         "--micro-batch or raise --batch)");
  EXPECT_TRUE(validate_micro_batches(parse_layout("pp=4,tsp=2").value(), 4).ok());
  // Interleaved: L >= p v, m a multiple of p, no --stage-layers, pp only.
  EXPECT_EQ(message("pp=2,tsp=1:interleaved=2"), "ok");
  EXPECT_EQ(message("pp=2,tsp=1:interleaved=3"),
            "pp=2,tsp=1:interleaved=3: 4 layers cannot fill 2 pipeline stages x 3 chunks = 6 chunks (at least one layer "
            "per chunk)");
  EXPECT_EQ(message("pp=2,tsp=1:interleaved=2", {2, 2}),
            "pp=2,tsp=1:stages=2/2:interleaved=2: --stage-layers sets contiguous stages, the interleaved schedule "
            "(interleaved:2) cuts the layers into chunks itself; drop one");
  EXPECT_EQ(message("tsp=1:interleaved=2"),
            "tsp=1:interleaved=2: the interleaved schedule (interleaved:2) is the pp axis's (a layout with pp=P)");
  const Layout inter = parse_layout("pp=2,tsp=2:interleaved=2").value();
  EXPECT_EQ(validate_micro_batches(inter, 3).message(),
            "pp=2,tsp=2:interleaved=2: 3 micro-batches per step must be a multiple of the 2 pipeline stages under the "
            "interleaved schedule (interleaved:2)");
  EXPECT_EQ(validate_micro_batches(inter, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(validate_micro_batches(inter, 4).ok());
  EXPECT_EQ(parse_schedule("interleaved:3").value(), (PipelineSchedule{3, false}));
  EXPECT_EQ(parse_schedule("1f1b").value(), PipelineSchedule{});
  EXPECT_EQ(parse_schedule("zb").value(), (PipelineSchedule{1, true}));
  EXPECT_EQ(parse_schedule("interleaved:0").status().message(),
            "--schedule interleaved:0: the pipeline schedules are 1f1b, interleaved:V (V >= 1 chunks per rank) and zb "
            "(ZB-H1)");
  // ZB-H1: pp only, not with interleaving, and on stages whose weight gradients can wait.
  EXPECT_EQ(message("pp=2,tsp=1:zb"), "ok");
  EXPECT_EQ(message("pp=2,tp=2:zb"), "ok");
  EXPECT_EQ(parse_layout("pp=2,tsp=1:zb")->to_string(), "pp=2,tsp=1:zb");
  EXPECT_EQ(schedule_name(parse_layout("pp=2,tsp=1:zb").value()), "zb");
  EXPECT_EQ(message("tsp=1:zb"), "tsp=1:zb: the zero-bubble schedule (zb) is the pp axis's (a layout with pp=P)");
  EXPECT_EQ(message("pp=2,tsp=1:interleaved=2:zb"),
            "pp=2,tsp=1:interleaved=2:zb: zb and interleaved:2 are two pipeline schedules; pick one");
  EXPECT_EQ(message("pp=2,tsp=2:zb"), "ok");
  EXPECT_EQ(message("pp=4,tsp=4:zb"), "ok");
  LlamaConfig mqa = c;
  mqa.num_key_value_heads = 1;
  EXPECT_TRUE(validate_layout(mqa, parse_layout("pp=2,tp=2:zb").value(), 0, 32).ok());
  EXPECT_TRUE(validate_layout(mqa, parse_layout("pp=2,tsp=2:zb").value(), 0, 32).ok());
  EXPECT_EQ(parse_layout("pp=2,tsp=1:interleaved=2")->chunks, 2);
  EXPECT_EQ(parse_layout("pp=2,tsp=1:interleaved=1")->to_string(), "pp=2,tsp=1");
}

TEST(PipelineErrors, TooFewMicroBatchesBeforeAnythingMoves) {
  Communicator& world = test::mpi().world();
  if (world.size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  // 1F1B with m = 1 < p; interleaved with m = 3, not a multiple of p.
  for (const auto& [text, m] : std::vector<std::pair<std::string, int>>{{"pp=2,tsp=1", 1},
                                                                        {"pp=2,tsp=1:interleaved=2", 3}}) {
    const Layout lo = parse_layout(text).value();
    const LlamaConfig c = test_config(4, false);
    Mesh mesh = Mesh::create(world, lo.mesh()).value();
    std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, lo).value();
    model->init_weights(kInit);
    auto be = make_cpu_backend();
    const Batch global = synthetic_batch(c, m, 32, 11, 0.1);
    std::vector<Batch> locals;
    for (int i = 0; i < m; ++i) locals.push_back(model->local_batch(rows(global, i, i + 1)));
    ScopedCommCounter counter(mesh.comm("pp"));
    const Result<StepResult> r = model->forward_backward_micro_batches(*be, locals, 0);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_EQ(counter.delta().total().calls, 0u) << text;
  }
}

// 1F1B keeps at most p - s micro-batches in flight on stage s: the step's activation peak on
// every stage is the same at m = p and m = 3p (up to boundary messages in flight) (a schedule that ran every forward first would
// hold m), and at most p - s times one micro-batch's (stage 0: p), each with its boundary
// message.
TEST(PipelineMemory, ActivationsInFlightAreBoundedByTheStages) {
  Communicator& world = test::mpi().world();
  bool ran = false;
  for (const std::string text : {"pp=2,tsp=1", "pp=4,tsp=1", "pp=2,tsp=2"}) {
    const Layout lo = parse_layout(text).value();
    if (lo.ranks() != world.size()) continue;
    ran = true;
    const LlamaConfig c = test_config(4, false);
    Mesh mesh = Mesh::create(world, lo.mesh()).value();
    std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, lo).value();
    model->init_weights(kInit);
    auto be = make_cpu_backend();
    const int P = lo.pp;
    const Batch global = synthetic_batch(c, 3 * P, 32, 11, 0.1);
    std::vector<Batch> locals;
    for (int i = 0; i < 3 * P; ++i) locals.push_back(model->local_batch(rows(global, i, i + 1)));
    auto activation_peak = [&](int m) {
      model->zero_grads(*be);
      MemoryTracker& t = MemoryTracker::process();
      const int64_t before = t.stats().current[static_cast<size_t>(MemCategory::kActivations)];
      t.reset_peaks();
      if (m == 1) {
        FP_CHECK_OK(model->forward_backward(*be, locals[0], 0).status());
      } else {
        const std::vector<Batch> some(locals.begin(), locals.begin() + m);
        FP_CHECK_OK(model->forward_backward_micro_batches(*be, some, 0).status());
      }
      return t.stats().peak[static_cast<size_t>(MemCategory::kActivations)] - before;
    };
    const int64_t single = activation_peak(1), one = activation_peak(P), three = activation_peak(3 * P);
    const int s = mesh.coord("pp");
    EXPECT_GT(single, 0);
    // A sent output [T, h] is kept until p more sends of its direction are posted or the step
    // ends (pipeline_boundary.h): up to p messages per direction the stage sends in, besides
    // the saved state of at most p - s micro-batches; the peak never grows with m beyond them.
    const int64_t message = 32 / lo.tsp * c.hidden_size * 4;
    const int64_t kept = ((s > 0 ? 1 : 0) + (s < P - 1 ? 1 : 0)) * P * message;
    EXPECT_LE(std::abs(three - one), kept) << text << " stage " << s << ": the peak grew with m";
    EXPECT_LE(one, (P - s) * single + kept) << text << " stage " << s << ": more than p - s in flight";
    if (s < P - 1) {
      EXPECT_GT(one, single) << text << " stage " << s << ": the stages never overlapped";
    }
  }
  if (!ran) GTEST_SKIP() << "no layout for " << world.size() << " ranks";
}

// ZB-H1 holds 1F1B's saved state plus the deferred weight-gradient inputs (each micro-batch's
// between its B and its W: PipelineModel::deferred_bytes) of at most s + 1 micro-batches on
// stage s (pipeline_schedule.h): stage 0's tracked peak exceeds 1F1B's by at most one
// micro-batch's deferred inputs, stage s's by s + 1 of them; at m = p and m = 3p.
TEST(PipelineMemory, ZeroBubblePeakIsOneFOneBsPlusTheDeferredWeightInputs) {
  Communicator& world = test::mpi().world();
  bool ran = false;
  for (const std::string text : {"pp=2,tsp=1", "pp=4,tsp=1", "pp=2,tsp=2"}) {
    Layout lo = parse_layout(text).value();
    if (lo.ranks() != world.size()) continue;
    ran = true;
    const LlamaConfig c = test_config(4, false);
    Mesh mesh = Mesh::create(world, lo.mesh()).value();
    auto be = make_cpu_backend();
    const int P = lo.pp, s = mesh.coord("pp");
    const Batch global = synthetic_batch(c, 3 * P, 32, 11, 0.1);
    // The step's own peak over everything the tracker counts, and the deferred bytes.
    auto peak = [&](bool zb, int m, int64_t* deferred) {
      Layout l = lo;
      l.zero_bubble = zb;
      std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, l).value();
      model->init_weights(kInit);
      model->zero_grads(*be);
      std::vector<Batch> locals;
      for (int i = 0; i < m; ++i) locals.push_back(model->local_batch(rows(global, i, i + 1)));
      MemoryTracker& t = MemoryTracker::process();
      const int64_t before = t.stats().current_total;
      t.reset_peaks();
      FP_CHECK_OK(model->forward_backward_micro_batches(*be, locals, 0).status());
      *deferred = dynamic_cast<PipelineModel&>(*model).deferred_bytes();
      return t.stats().peak_total - before;
    };
    for (int m : {P, 3 * P}) {
      int64_t none = 0, deferred = 0;
      const int64_t one_f_one_b = peak(false, m, &none), zero_bubble = peak(true, m, &deferred);
      EXPECT_EQ(none, 0);
      EXPECT_GT(deferred, 0);
      EXPECT_LE(zero_bubble, one_f_one_b + (s + 1) * deferred) << text << " stage " << s << " m " << m;
      std::printf("%s m %d stage %d: peak 1F1B %lld B, ZB-H1 %lld B (%+lld), one micro-batch's deferred W inputs %lld B\n",
                  text.c_str(), m, s, static_cast<long long>(one_f_one_b), static_cast<long long>(zero_bubble),
                  static_cast<long long>(zero_bubble - one_f_one_b), static_cast<long long>(deferred));
    }
  }
  if (!ran) GTEST_SKIP() << "no layout for " << world.size() << " ranks";
}

// Interleaved 1F1B keeps at most min(warm-up + 1, m v) (chunk, micro-batch) pairs in flight
// (pipeline_schedule.h): from m = 2p on the warm-up no longer grows, so the activation peak at
// m = 4p equals m = 2p's up to the boundary messages kept; and it exceeds one micro-batch's
// (its chunks overlap).
TEST(PipelineMemory, InterleavedActivationsStopGrowingWithTheMicroBatches) {
  Communicator& world = test::mpi().world();
  if (world.size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  const Layout lo = parse_layout("pp=2,tsp=1:interleaved=2").value();
  const LlamaConfig c = test_config(4, false);
  Mesh mesh = Mesh::create(world, lo.mesh()).value();
  std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, lo).value();
  model->init_weights(kInit);
  auto be = make_cpu_backend();
  const int P = lo.pp;
  const Batch global = synthetic_batch(c, 4 * P, 32, 11, 0.1);
  std::vector<Batch> locals;
  for (int i = 0; i < 4 * P; ++i) locals.push_back(model->local_batch(rows(global, i, i + 1)));
  auto activation_peak = [&](int m) {
    model->zero_grads(*be);
    MemoryTracker& t = MemoryTracker::process();
    const int64_t before = t.stats().current[static_cast<size_t>(MemCategory::kActivations)];
    t.reset_peaks();
    const std::vector<Batch> some(locals.begin(), locals.begin() + m);
    if (m == 1) FP_CHECK_OK(model->forward_backward(*be, locals[0], 0).status());
    else FP_CHECK_OK(model->forward_backward_micro_batches(*be, some, 0).status());
    return t.stats().peak[static_cast<size_t>(MemCategory::kActivations)] - before;
  };
  const int64_t single = activation_peak(1), two = activation_peak(2 * P), four = activation_peak(4 * P);
  const int64_t message = 32 * c.hidden_size * 4;
  const int64_t kept = 2 * P * message;  // both directions, p each, on either rank
  EXPECT_LE(std::abs(four - two), kept) << "the peak grew with m";
  EXPECT_GT(two, single) << "no (chunk, micro-batch) pairs overlapped";
}

// Under pp a stage's model-axis traffic is the single-stage step's per micro-batch, m times
// (TSP moves its weight shards again for every micro-batch), plus what closes the step once
// (the norm gains' sum): per operation kind, T(m) = a m + b exactly, so T(4) - T(2) is twice
// T(2) - T(1). And none of it is on the pp axis.
TEST(PipelineTraffic, ModelAxisBytesGrowByTheSameAmountPerMicroBatch) {
  Communicator& world = test::mpi().world();
  bool ran = false;
  for (const std::string text : {"pp=2,tsp=2", "pp=2,tp=2", "pp=2,tsp=1"}) {
    const Layout lo = parse_layout(text).value();
    if (lo.ranks() != world.size()) continue;
    ran = true;
    const LlamaConfig c = test_config(4, true);
    Mesh mesh = Mesh::create(world, lo.mesh()).value();
    std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, lo).value();
    model->init_weights(kInit);
    auto be = make_cpu_backend();
    const Batch global = synthetic_batch(c, 4, 32, 11, 0.1);
    const Communicator& axis = mesh.comm(lo.strategy == Strategy::kTsp ? "tsp" : "tp");
    auto traffic = [&](int m) {
      std::vector<Batch> locals;
      for (int i = 0; i < m; ++i) locals.push_back(model->local_batch(rows(global, i, i + 1)));
      model->zero_grads(*be);
      ScopedCommCounter counter(axis);
      if (m == 1) FP_CHECK_OK(model->forward_backward(*be, locals[0], 0).status());
      else FP_CHECK_OK(model->forward_backward_micro_batches(*be, locals, 0).status());
      return counter.delta();
    };
    const CommStats t1 = traffic(1), t2 = traffic(2), t4 = traffic(4);
    for (int k = 0; k < kNumCommOpKinds; ++k) {
      const auto kind = static_cast<CommOpKind>(k);
      EXPECT_EQ(t4.op(kind).bytes_sent - t2.op(kind).bytes_sent, 2 * (t2.op(kind).bytes_sent - t1.op(kind).bytes_sent))
          << text << " " << comm_op_name(kind);
      EXPECT_EQ(t4.op(kind).calls - t2.op(kind).calls, 2 * (t2.op(kind).calls - t1.op(kind).calls))
          << text << " " << comm_op_name(kind);
    }
    if (axis.size() > 1) {
      EXPECT_GT(t2.total().bytes_sent, t1.total().bytes_sent) << text;
    }
  }
  if (!ran) GTEST_SKIP() << "no layout for " << world.size() << " ranks";
}

// ZB-H1 on tsp=D stages moves the reduces and the gradient ring from B into W, nothing more:
// per operation kind its TSP-axis calls and bytes equal 1F1B's exactly at m = p and 2p (so
// the single-stage formula times m, by the test above), with KV replicas too (their copy in
// W), and nothing extra crosses the pp axis. Likewise tp stages with KV replicas (their KV
// group's sum in W).
TEST(PipelineTraffic, ZeroBubbleMovesTheTspAxisBytesOfOneFOneB) {
  Communicator& world = test::mpi().world();
  bool ran = false;
  for (const std::string text : {"pp=2,tsp=2", "pp=4,tsp=2", "pp=2,tsp=4", "pp=2,tp=2", "pp=2,tp=4"}) {
    for (const int64_t kv_heads : {4, 1}) {
      const Layout lo = parse_layout(text).value();
      if (lo.ranks() != world.size()) continue;
      ran = true;
      LlamaConfig c = test_config(4, true);
      c.num_key_value_heads = kv_heads;
      Mesh mesh = Mesh::create(world, lo.mesh()).value();
      auto be = make_cpu_backend();
      const Batch global = synthetic_batch(c, 2 * lo.pp, 32, 11, 0.1);
      auto traffic = [&](bool zb, int m, const std::string& axis) {
        Layout l = lo;
        l.zero_bubble = zb;
        std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, l).value();
        model->init_weights(kInit);
        model->zero_grads(*be);
        std::vector<Batch> locals;
        for (int i = 0; i < m; ++i) locals.push_back(model->local_batch(rows(global, i, i + 1)));
        ScopedCommCounter counter(mesh.comm(axis));
        FP_CHECK_OK(model->forward_backward_micro_batches(*be, locals, 0).status());
        return counter.delta();
      };
      for (int m : {lo.pp, 2 * lo.pp}) {
        const std::string model_axis = lo.strategy == Strategy::kTsp ? "tsp" : "tp";
        for (const std::string& axis : {model_axis, std::string("pp")}) {
          const CommStats one_f_one_b = traffic(false, m, axis), zero_bubble = traffic(true, m, axis);
          for (int k = 0; k < kNumCommOpKinds; ++k) {
            const auto kind = static_cast<CommOpKind>(k);
            EXPECT_EQ(zero_bubble.op(kind).bytes_sent, one_f_one_b.op(kind).bytes_sent)
                << text << " n_kv " << kv_heads << " m " << m << " " << axis << " " << comm_op_name(kind);
            EXPECT_EQ(zero_bubble.op(kind).calls, one_f_one_b.op(kind).calls)
                << text << " n_kv " << kv_heads << " m " << m << " " << axis << " " << comm_op_name(kind);
          }
          if (axis == "tsp") {
            EXPECT_GT(zero_bubble.op(CommOpKind::kReduce).calls, 0u) << text;
          }
          if (axis == "tp" && kv_heads == 1) {  // the KV group's sums (sum_kv_replicas)
            EXPECT_GT(zero_bubble.op(CommOpKind::kSend).calls, 0u) << text;
          }
        }
      }
    }
  }
  if (!ran) GTEST_SKIP() << "no layout for " << world.size() << " ranks";
}

TEST(PipelineForward, LossEqualsTheSingleRankModelsOnEveryStage) {
  Communicator& world = test::mpi().world();
  bool ran = false;
  for (const std::string text : {"pp=2,tsp=1", "pp=2,tsp=2", "pp=4,tsp=1", "pp=2,tsp=1:interleaved=2",
                                 "pp=2,tsp=2:interleaved=2"}) {
    const Layout lo = parse_layout(text).value();
    if (lo.ranks() != world.size()) continue;
    ran = true;
    const LlamaConfig c = test_config(4, true);
    LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
    init_weights(kInit, w);
    const Batch global = synthetic_batch(c, 2, 32, 5, 0.1);
    auto be = make_cpu_backend();
    const double ref = model_forward(c, *be, w, global, StepOptions{}).value().loss;
    Mesh mesh = Mesh::create(world, lo.mesh()).value();
    std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, lo).value();
    model->init_weights(kInit);
    const StepResult r = model->forward(*be, model->local_batch(global)).value();
    EXPECT_NEAR(r.loss, ref, tol::kF32Parallel * ref) << text;
  }
  if (!ran) GTEST_SKIP() << "no layout for " << world.size() << " ranks";
}

// bf16 storage over Megatron stages (pp=2 over tp=N or sp=M, :bf16): the stages store
// weights and activations in bf16 and compute through the bf16 storage decorator, as
// `train --bf16` runs them. Against the single-rank model in bf16 with the same weights: the
// loss within one bf16 ulp (2^-8 relative; a mean over the batch's tokens, observed 5e-5)
// and every gradient within 16 ulp = 6.25e-2 normwise (the layouts round partial sums that
// the single-rank model rounds once; the derivation is megatron_parity_test.cc's "bf16
// storage" section, observed ~2e-2). The boundary moves bf16: 2 bytes an element.
// A bf16 layout (its ranks the world's) with a case's model.
void check_bf16_parity(const Layout& lo, const Case& k) {
  constexpr double kUlp = 1.0 / 256;
  Communicator& world = test::mpi().world();
  SCOPED_TRACE(lo.to_string());
  const LlamaConfig c = case_config(k);
  const int m = 2 * lo.pp;
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  LlamaWeights w = LlamaWeights::allocate(c, DType::kBF16, MemCategory::kParameters);
  init_weights(kInit, w);
  const Batch global = synthetic_batch(c, m, 32, 11, 0.1);
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  Result<StepResult> ref = model_forward_backward(c, *bf, w, global, StepOptions{}, ref_g);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();

  Mesh mesh = Mesh::create(world, lo.mesh()).value();
  std::unique_ptr<ShardedModel> model = make_sharded_model(c, mesh, 32, lo).value();
  model->init_weights(kInit);
  model->zero_grads(*bf);
  std::vector<Batch> locals;
  for (int i = 0; i < m; ++i) locals.push_back(model->local_batch(rows(global, i, i + 1)));
  ScopedCommCounter counter(mesh.comm("pp"));
  Result<StepResult> got = model->forward_backward_micro_batches(*bf, locals, ref->valid_tokens);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  const CommStats pp_traffic = counter.delta();
  EXPECT_EQ(got->valid_tokens, ref->valid_tokens);
  EXPECT_NEAR(got->loss, ref->loss, kUlp * ref->loss);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model->assemble_grads(assembled).ok());
  std::vector<Tensor> ref_list;
  ref_g.for_each([&](const std::string&, Tensor& t) { ref_list.push_back(t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    const Tensor& r = ref_list[i++];
    EXPECT_LE(max_rel_error(t, r), 16 * kUlp) << name << " on rank " << world.rank() << "\n"
                                              << describe_mismatches(t, r, 16 * kUlp);
  });
  // Each boundary message is [rows, h] bf16.
  const int s = mesh.coord("pp");
  const uint64_t sends = static_cast<uint64_t>((s < lo.pp - 1 ? m : 0) + (s > 0 ? m : 0));
  const uint64_t msg = static_cast<uint64_t>(locals[0].input_ids.numel() * c.hidden_size * 2);
  EXPECT_EQ(pp_traffic.op(CommOpKind::kSend).bytes_sent, sends * msg) << "stage " << s;
}

// Runs check_bf16_parity if the world has the layout's ranks; false (skipped) otherwise.
bool run_bf16_parity(const std::string& text, const Case& k) {
  const Layout lo = parse_layout(text).value();
  if (lo.ranks() != test::mpi().world().size()) return false;
  check_bf16_parity(lo, k);
  return true;
}

TEST(PipelineBf16, MegatronStagesMatchTheSingleRankBf16Model) {
  bool ran = false;
  for (const std::string text : {"pp=2,tp=1:bf16", "pp=2,tp=2:bf16", "pp=2,tp=2:seqpar:bf16", "pp=2,sp=2:bf16"})
    ran = run_bf16_parity(text, Case{.layers = 3}) || ran;
  if (!ran) GTEST_SKIP() << "no layout for " << test::mpi().world().size() << " ranks";
}

// The attention variants and KV replicas in bf16 on Megatron and TSP stages (the biases and
// gains stored bf16 like the weights, their gradients f32).
TEST(PipelineBf16, AttentionVariantsAndKvReplicasMatchTheSingleRankBf16Model) {
  bool ran = false;
  const std::pair<std::string, Case> cases[] = {
      {"pp=2,tsp=1:bf16", Case{.layers = 3, .variant = Variant::kQwen3}},
      {"pp=2,tp=1:bf16", Case{.layers = 3, .variant = Variant::kQwen2}},
      {"pp=2,tsp=2:bf16", Case{.layers = 3, .variant = Variant::kAttentionBias, .kv_heads = 1}},
      {"pp=2,tp=2:seqpar:bf16", Case{.layers = 3, .variant = Variant::kQwen3, .kv_heads = 1}},
      {"pp=2,sp=2:bf16", Case{.layers = 3, .variant = Variant::kAttentionBias}},
      {"pp=2,tsp=1:bf16", Case{.layers = 3, .variant = Variant::kAllBiases}},
      {"pp=2,tsp=2:bf16", Case{.layers = 3, .variant = Variant::kMlpBias}},
      {"pp=2,tp=2:seqpar:bf16", Case{.layers = 3, .variant = Variant::kAllBiases}}};
  for (const auto& [text, k] : cases) ran = run_bf16_parity(text, k) || ran;
  if (!ran) GTEST_SKIP() << "no layout for " << test::mpi().world().size() << " ranks";
}

// ZB-H1 in bf16 storage on tsp=2 stages and on tp stages with KV replicas: the deferred
// products read bf16 operands into the f32 gradients and partials, as the direct backward.
TEST(PipelineBf16, ZeroBubbleMatchesTheSingleRankBf16Model) {
  bool ran = false;
  const std::pair<std::string, Case> cases[] = {
      {"pp=2,tsp=2:bf16:zb", Case{.layers = 3, .variant = Variant::kAllBiases}},
      {"pp=2,tsp=2:bf16:zb", Case{.layers = 3, .variant = Variant::kQwen3, .kv_heads = 1}},
      {"pp=2,tp=2:bf16:zb", Case{.layers = 3, .variant = Variant::kQwen2, .kv_heads = 1}}};
  for (const auto& [text, k] : cases) ran = run_bf16_parity(text, k) || ran;
  if (!ran) GTEST_SKIP() << "no layout for " << test::mpi().world().size() << " ranks";
}

}  // namespace
}  // namespace foldpar
