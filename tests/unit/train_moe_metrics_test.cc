// The metrics line of a mixture-of-experts model (train/trainer.cc): `aux_loss` (the aux
// term inside `loss`), `lm_loss` (`loss` without it) and `expert_load` (one count per expert,
// summed over the sparse layers, the ranks and the micro-batches). One rank, against the
// single-rank model on the step's batch (the loader's rows of step 0 and the trainer's
// initialization): the first step's aux term is coef x the model's aux loss on the whole batch,
// or with micro-batches each one's aux loss weighted by its share of the valid targets.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/self_communicator.h"
#include "data/corpus.h"
#include "data/data_loader.h"
#include "io/token_file.h"
#include "layout/layout.h"
#include "model/llama_model.h"
#include "train/trainer.h"

namespace foldpar {
namespace {

namespace fs = std::filesystem;

LlamaConfig tiny_moe() {
  LlamaConfig c;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 48;
  c.vocab_size = 256;  // the byte tokenizer
  c.num_hidden_layers = 3;
  c.max_position_embeddings = 128;
  MoeConfig& m = c.moe;
  m.family = MoeFamily::kQwen3;
  m.num_experts = 4;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 16;
  m.norm_topk_prob = true;
  m.mlp_only_layers = {1};  // layers 0 and 2 sparse
  m.router_aux_loss_coef = 0.1;
  m.output_router_logits = true;
  return c;
}

struct TrainRun {
  std::vector<nlohmann::json> lines;
  Status status;
};

// `steps` steps of tiny_moe on one rank with `micro_batch` sequences per forward.
TrainRun train(const fs::path& dir, const std::string& data, int64_t micro_batch, TrainOptions& o) {
  o.config = tiny_moe();
  o.layout = parse_layout("tsp=1").value();
  o.data_dir = data;
  o.seq = 32;
  o.batch = 4;
  o.micro_batch = micro_batch;
  o.steps = 2;
  o.eval_every = 0;
  o.eval_batches = 1;
  o.print_every = 0;
  o.seed = 7;
  o.out_dir = (dir / ("run" + std::to_string(micro_batch))).string();
  SelfCommunicator world("world", 0);
  TrainRun run;
  run.status = run_training(o, world).status();
  std::ifstream metrics(fs::path(o.out_dir) / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) run.lines.push_back(nlohmann::json::parse(line));
  return run;
}

TEST(TrainMoeMetrics, AuxLossAndExpertLoadOfEveryStep) {
  const fs::path dir = fs::temp_directory_path() / ("foldpar_moe_metrics_" + std::to_string(getpid()));
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "text");
    for (int i = 0; i < 300; ++i) f << "line " << i << ": experts share the tokens\n%\n";
  }
  PrepareOptions prep;
  prep.inputs = {(dir / "text").string()};
  prep.out_dir = (dir / "data").string();
  prep.tokenizer = "bytes";
  ASSERT_TRUE(prepare_corpus(prep).ok());
  TrainOptions whole, micro;
  const TrainRun a = train(dir, prep.out_dir, 0, whole), b = train(dir, prep.out_dir, 1, micro);

  // The single-rank model on step 0's batch, as the trainer initializes it.
  const LlamaConfig c = tiny_moe();
  Result<CorpusInfo> corpus = read_corpus_info(prep.out_dir);
  ASSERT_TRUE(corpus.ok()) << corpus.status().to_string();
  Result<TokenFile> tokens = read_token_file(corpus->train_path);
  ASSERT_TRUE(tokens.ok());
  Result<DataLoader> loader = DataLoader::create(std::make_shared<TokenFile>(std::move(*tokens)), whole.seq, whole.seed);
  ASSERT_TRUE(loader.ok());
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = whole.seed}, w);
  auto be = make_cpu_backend();
  const Batch batch = loader->train_rows(0, 0, whole.batch);
  Result<StepResult> ref = model_forward(c, *be, w, batch, StepOptions{});
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  // Each sequence alone (the micro-batch run's micro-batches), weighted by its valid targets.
  double micro_aux = 0, micro_ce = 0;
  for (int64_t s = 0; s < whole.batch; ++s) {
    Result<StepResult> r = model_forward(c, *be, w, loader->train_rows(0, s, s + 1), StepOptions{});
    ASSERT_TRUE(r.ok());
    micro_aux += r->aux_loss * static_cast<double>(r->valid_tokens) / static_cast<double>(ref->valid_tokens);
    micro_ce += r->loss_sum / static_cast<double>(ref->valid_tokens);
  }
  fs::remove_all(dir);
  ASSERT_TRUE(a.status.ok()) << a.status.to_string();
  ASSERT_TRUE(b.status.ok()) << b.status.to_string();
  ASSERT_EQ(a.lines.size(), 2u);
  ASSERT_EQ(b.lines.size(), 2u);

  const int64_t sparse = c.moe.sparse_layer_count(c.num_hidden_layers), k = c.moe.num_experts_per_tok;
  for (const TrainRun* run : {&a, &b})
    for (const nlohmann::json& l : run->lines) {
      // Every token of the global batch chose k experts in every sparse layer.
      const std::vector<int64_t> load = l.at("expert_load").get<std::vector<int64_t>>();
      ASSERT_EQ(static_cast<int64_t>(load.size()), c.moe.num_experts) << l.dump();
      int64_t total = 0;
      for (int64_t n : load) total += n;
      EXPECT_EQ(total, whole.batch * whole.seq * k * sparse) << l.dump();
      EXPECT_NEAR(l.at("lm_loss").get<double>() + l.at("aux_loss").get<double>(), l.at("loss").get<double>(), 1e-12)
          << l.dump();
      EXPECT_GT(l.at("aux_loss").get<double>(), 0.0);
    }
  // Step 1 (weights as initialized): the whole batch's aux loss, or the micro-batches' weighted.
  // The trainer's model is the same single-rank model on the same backend: equal but for the
  // order of a few sums (1e-12 relative).
  const double coef = c.moe.router_aux_loss_coef;
  const nlohmann::json &first = a.lines[0], &first_micro = b.lines[0];
  EXPECT_NEAR(first.at("aux_loss").get<double>(), coef * ref->aux_loss, 1e-12 * coef * ref->aux_loss);
  EXPECT_NEAR(first.at("lm_loss").get<double>(), ref->loss_sum / static_cast<double>(ref->valid_tokens),
              1e-12 * ref->loss);
  EXPECT_EQ(first.at("expert_load").get<std::vector<int64_t>>(), ref->expert_load);
  EXPECT_NEAR(first_micro.at("aux_loss").get<double>(), coef * micro_aux, 1e-12 * coef * micro_aux);
  EXPECT_NEAR(first_micro.at("lm_loss").get<double>(), micro_ce, 1e-12 * micro_ce);
  EXPECT_EQ(first_micro.at("expert_load").get<std::vector<int64_t>>(), ref->expert_load);
}

}  // namespace
}  // namespace foldpar
