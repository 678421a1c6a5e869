// An MPI program that goes wrong on purpose, one way per scenario; comm_failure_test.cc
// launches it under mpirun and checks how the job ends. Every rank prints
// "rank R started pid P" first and "rank R exits normally" only on a normal exit (the one path
// to exit status 0), so the driver can tell that no rank finished normally.
//   comm_failure_job <scenario> <marker>     (the marker only tags the processes)
// Scenarios (rank counts as the driver launches them):
//   skip      3 ranks, checking mode: rank 1 skips all_reduce #2 and calls all_gather
//   count     3 ranks, checking mode: rank 2 passes another count to all_gather
//   root      3 ranks, checking mode: rank 0 names another broadcast root
//   hang      3 ranks: rank 2 never arrives at all_reduce #2 (sleeps in computation)
//   hang_p2p  2 ranks: rank 0 waits in recv from rank 1, which never sends
//   sigkill   3 ranks: rank 1 dies by SIGKILL with an all_reduce in flight
//   fatal     3 ranks: rank 1 fails an FP_CHECK while the others wait in a barrier
//   truncate  2 ranks: rank 1 receives 5 elements of a 10-element message (an MPI error)
//   short     2 ranks: rank 1 expects 10 elements of a 5-element message
//   purpose_elsewhere 3 ranks: rank 0 waits in an all_reduce on {0,2}; rank 2 sleeps; rank 1,
//             a second later, waits in a recv from rank 2 that has a purpose
//   pp_stall  4 ranks, pp=2,tsp=2, m = 4: world rank 1 (stage 0, tsp index 1) stalls before
//             it sends the activation of micro-batch 2 (a boundary hook)
//   pp_decode_stall 4 ranks, pp=2,tsp=2 generation of B = 2 (two groups): world rank 1
//             stalls before it sends group 1's activation in the first decode step
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "app/synthetic.h"
#include "backend/backend.h"
#include "comm/mesh.h"
#include "comm/mpi_runtime.h"
#include "core/check.h"
#include "parallel/make_layout.h"
#include "parallel/pipeline/pipeline_decoder.h"
#include "parallel/pipeline/pipeline_model.h"

namespace foldpar {
namespace {

void sleep_s(int seconds) { std::this_thread::sleep_for(std::chrono::seconds(seconds)); }

// One 1F1B step of a tiny model under pp=2,tsp=2 with m = 4 micro-batches; world rank 1
// sleeps before sending micro-batch 2's activation to stage 1.
void run_pipeline_stall(Communicator& world) {
  LlamaConfig c;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 64;
  c.vocab_size = 64;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 64;
  const int64_t seq = 16, m = 4;
  const Layout layout = parse_layout("pp=2,tsp=2").value();
  Result<Mesh> mesh = Mesh::create(world, layout.mesh());
  FP_CHECK_OK(mesh.status());
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, seq, layout);
  FP_CHECK_OK(made.status());
  auto* model = dynamic_cast<PipelineModel*>(made->get());
  FP_CHECK(model != nullptr, "pp=2,tsp=2 should build a PipelineModel");
  const int me = world.rank();
  model->set_boundary_hooks({[me](BoundaryDirection direction, int i) {
    if (me == 1 && direction == BoundaryDirection::kActivation && i == 2) sleep_s(60);
  }});
  auto be = make_cpu_backend();
  model->init_weights(InitOptions{.seed = 3, .std = 0.1});
  model->zero_grads(*be);
  const Batch global = synthetic_batch(c, m, seq, 5, 0.0);
  std::vector<Batch> locals;
  for (int64_t i = 0; i < m; ++i)
    locals.push_back(model->local_batch(Batch{global.input_ids.narrow(i, i + 1), global.target_ids.narrow(i, i + 1)}));
  FP_CHECK_OK(model->forward_backward_micro_batches(*be, locals, m * seq).status());
}

// Generation under pp=2,tsp=2: a prefill of two prompts, then a decode step of two groups;
// world rank 1 sleeps before sending group 1's activation to stage 1.
void run_pipeline_decode_stall(Communicator& world) {
  LlamaConfig c;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 64;
  c.vocab_size = 64;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 64;
  const Layout layout = parse_layout("pp=2,tsp=2").value();
  Result<Mesh> mesh = Mesh::create(world, layout.mesh());
  FP_CHECK_OK(mesh.status());
  Result<std::unique_ptr<ShardedDecoder>> made = make_sharded_decoder(c, *mesh, layout);
  FP_CHECK_OK(made.status());
  auto* decoder = dynamic_cast<PipelineDecoder*>(made->get());
  FP_CHECK(decoder != nullptr, "pp=2,tsp=2 should build a PipelineDecoder");
  const int me = world.rank();
  bool decoding = false;  // the prefill's two groups cross the same boundary first
  decoder->set_boundary_hooks({[me, &decoding](BoundaryDirection direction, int i) {
    if (me == 1 && decoding && direction == BoundaryDirection::kActivation && i == 1) sleep_s(60);
  }});
  decoder->init_weights(InitOptions{.seed = 3, .std = 0.1});
  auto be = make_cpu_backend();
  FP_CHECK_OK(decoder->prefill(*be, {{1, 2, 3}, {4, 5}}, 2).status());
  decoding = true;
  const std::vector<int32_t> tokens{6, 7};
  FP_CHECK_OK(decoder->decode(*be, tokens).status());
}

void run_scenario(const std::string& scenario, Communicator& world) {
  const int p = world.rank();
  std::vector<float> x(1 << 22, 1.0f), y(64 * world.size());
  FP_CHECK_OK(world.barrier());  // #1: everyone is up
  if (scenario == "skip") {
    if (p != 1) FP_CHECK_OK(world.all_reduce(x.data(), x.data(), 100, DType::kF32, ReduceOp::kSum));
    FP_CHECK_OK(world.all_gather(x.data(), y.data(), 10, DType::kF32));
  } else if (scenario == "count") {
    FP_CHECK_OK(world.all_gather(x.data(), y.data(), p == 2 ? 5 : 4, DType::kF32));
  } else if (scenario == "root") {
    FP_CHECK_OK(world.broadcast(x.data(), 16, DType::kF32, p == 0 ? 1 : 0));
  } else if (scenario == "hang") {
    if (p == 2) sleep_s(60);
    FP_CHECK_OK(world.all_reduce(x.data(), x.data(), 100, DType::kF32, ReduceOp::kSum));
  } else if (scenario == "hang_p2p") {
    if (p == 1) sleep_s(60);
    if (p == 0) FP_CHECK_OK(world.recv(x.data(), 100, DType::kF32, 1));
  } else if (scenario == "sigkill") {
    if (p == 1) {
      CommRequest r = world.iall_reduce(x.data(), x.data(), x.size(), DType::kF32, ReduceOp::kSum);
      sleep_s(1);
      std::raise(SIGKILL);
    }
    FP_CHECK_OK(world.all_reduce(x.data(), x.data(), x.size(), DType::kF32, ReduceOp::kSum));
  } else if (scenario == "fatal") {
    FP_CHECK(p != 1, "deliberate failure of scenario {}", scenario);
    FP_CHECK_OK(world.barrier());
  } else if (scenario == "truncate" || scenario == "short") {
    const size_t sent = scenario == "truncate" ? 10 : 5, expected = scenario == "truncate" ? 5 : 10;
    if (p == 0) FP_CHECK_OK(world.send(x.data(), sent, DType::kF32, 1));
    if (p == 1) FP_CHECK_OK(world.recv(y.data(), expected, DType::kF32, 0));
    FP_CHECK_OK(world.barrier());
  } else if (scenario == "purpose_elsewhere") {
    std::unique_ptr<Communicator> pair = world.split(p == 1 ? 1 : 0, p, "pair");
    if (p == 2) sleep_s(60);
    if (p == 0) FP_CHECK_OK(pair->all_reduce(x.data(), x.data(), 100, DType::kF32, ReduceOp::kSum));
    if (p == 1) {
      sleep_s(1);
      CommOp op;
      op.kind = CommOpKind::kRecv;
      op.recv_buf = x.data();
      op.count = 100;
      op.source = 2;
      op.purpose.format = "test: rank {0} never sent token {1} ({6})";
      op.purpose.args = {2, 17};
      op.purpose.text = "a purpose";
      FP_CHECK_OK(world.run(op));
    }
  } else if (scenario == "pp_stall") {
    run_pipeline_stall(world);
  } else if (scenario == "pp_decode_stall") {
    run_pipeline_decode_stall(world);
  } else {
    FP_CHECK(false, "unknown scenario {}", scenario);
  }
}

}  // namespace
}  // namespace foldpar

int main(int argc, char** argv) {
  using foldpar::CommOptions, foldpar::MpiRuntime, foldpar::Result;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <scenario> <marker>\n", argv[0]);
    return 2;
  }
  Result<CommOptions> options = CommOptions::from_env();
  if (!options.ok()) {
    std::fprintf(stderr, "%s\n", options.status().to_string().c_str());
    return 2;
  }
  MpiRuntime mpi(&argc, &argv, options.value());
  std::printf("rank %d started pid %d\n", mpi.world_rank(), static_cast<int>(getpid()));
  std::fflush(stdout);
  foldpar::run_scenario(argv[1], mpi.world());
  std::printf("rank %d exits normally\n", mpi.world_rank());
  std::fflush(stdout);
  return 0;
}
