// Dry run: the counting mesh, the storage-less tracker and the meta backend around one step
// of the real strategy.
#include "plan/dry_run.h"

#include "parallel/make_layout.h"
#include "tensor/storageless_allocator.h"

namespace foldpar {
namespace {

// The rows [B_local, S_local] this rank feeds the model: the strategy's local_batch of a
// host batch (made on the process tracker: preparing input is the loader's work, not the
// step's), re-made storage-less with the same shapes and categories.
Result<Batch> storageless_local_batch(const ShardedModel& model, int64_t rows, int64_t seq, MemoryTracker& meta) {
  Batch host;
  {
    ScopedDefaultTracker on_host(MemoryTracker::process());
    host.input_ids = Tensor::zeros({rows, seq}, DType::kI32, MemCategory::kActivations);
    host.target_ids = Tensor::zeros({rows, seq}, DType::kI32, MemCategory::kActivations);
    host = model.local_batch(host);
  }
  Batch local;
  local.input_ids = Tensor::empty(host.input_ids.shape(), DType::kI32, host.input_ids.category(), meta);
  local.target_ids = Tensor::empty(host.target_ids.shape(), DType::kI32, host.target_ids.category(), meta);
  return local;
}

}  // namespace

Result<DryRunResult> dry_run(const DryRunOptions& o) {
  FP_RETURN_IF_ERROR(validate_layout(o.config, o.layout, o.batch, o.seq));
  FP_ASSIGN_OR_RETURN(MeshLayout mesh_layout, MeshLayout::parse(o.layout.mesh()));
  install_storageless_fault_handler();
  DryRunResult out;
  EventOrder order;
  FP_ASSIGN_OR_RETURN(CountingMesh cm, make_counting_mesh(mesh_layout, o.rank, order, out.comm_trace));
  std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
  MetaBackend backend(MetaBackendOptions{.order = &order, .matmul_takes_bf16 = o.matmul_takes_bf16});
  const int64_t rows = o.batch / cm.mesh->degree("dp");
  {
    ScopedDefaultTracker scope(*meta);
    FP_ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> model,
                        make_sharded_model(o.config, *cm.mesh, o.seq, o.layout));
    FP_ASSIGN_OR_RETURN(Batch local, storageless_local_batch(*model, rows, o.seq, *meta));
    out.after_build = meta->stats();
    meta->reset_peaks();
    std::vector<CommStats> before;
    for (const Communicator* c : cm.mesh->communicators()) before.push_back(c->stats());
    if (o.mode == DryRunMode::kForwardBackward) {
      // The trainer's normalizer: the valid tokens of the global batch (every token here).
      FP_ASSIGN_OR_RETURN(out.result, model->forward_backward(backend, local, o.batch * o.seq));
    } else {
      FP_ASSIGN_OR_RETURN(out.result, model->forward(backend, local));
    }
    out.step = meta->stats();
    out.result.logits = Tensor();
    const std::vector<const Communicator*> comms = cm.mesh->communicators();
    for (size_t i = 0; i < comms.size(); ++i) out.comm.emplace_back(comms[i]->name(), comms[i]->stats() - before[i]);
  }
  out.ops = backend.records();
  return out;
}

}  // namespace foldpar
