// Dry run: the counting mesh, the storage-less tracker and the meta backend around one step
// of the real strategy.
#include "plan/dry_run.h"

#include <algorithm>
#include <cmath>

#include "backend/bf16_storage_backend.h"
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

// The step of a training-side mode on `model`, between the snapshots `measure` takes: one
// batch, or the trainer's micro-batches.
Status run_model_step(const DryRunOptions& o, ShardedModel& model, const std::vector<Batch>& locals, Backend& backend,
                      DryRunResult& out) {
  // The trainer's normalizer: the valid tokens of the global batch (every token here).
  if (o.mode == DryRunMode::kForwardBackward && locals.size() > 1) {
    FP_ASSIGN_OR_RETURN(out.result, model.forward_backward_micro_batches(backend, locals, o.batch * o.seq));
  } else if (o.mode == DryRunMode::kForwardBackward) {
    // A MoE model refuses a normalizer other than the step's own valid count (its aux loss is
    // over the whole batch), which a dry run's all_reduce cannot sum (it returns this rank's):
    // 0 says "the step's own", the same shapes and traffic (only the gradients' scale).
    const int64_t normalizer = o.config.moe.enabled() ? 0 : o.batch * o.seq;
    FP_ASSIGN_OR_RETURN(out.result, model.forward_backward(backend, locals.front(), normalizer));
  } else {
    FP_ASSIGN_OR_RETURN(out.result, model.forward(backend, locals.front()));
  }
  out.result.logits = Tensor();
  return Status();
}

// Snapshots the tracker and the axis counters around `step`: after_build before it, the
// step's peaks and traffic after it.
template <typename Step>
Status measure(MemoryTracker& meta, const Mesh& mesh, const EventOrder& order, DryRunResult& out, Step&& step) {
  out.after_build = meta.stats();
  meta.reset_peaks();
  out.step_first_seq = order.last() + 1;
  const std::vector<const Communicator*> comms = mesh.communicators();
  std::vector<CommStats> before;
  for (const Communicator* c : comms) before.push_back(c->stats());
  FP_RETURN_IF_ERROR(step());
  out.step = meta.stats();
  for (size_t i = 0; i < comms.size(); ++i) out.comm.emplace_back(comms[i]->name(), comms[i]->stats() - before[i]);
  return Status();
}

// Communicators built beside the mesh's axes (a MoE model's tp x sp expert axis "ep" on the
// Megatron layouts, parallel/make_layout.cc) count like the axes: their step's operations
// from the trace, as their counters would have them.
void add_traffic_beside_the_mesh(const Mesh& mesh, DryRunResult& out) {
  std::vector<std::string> named{"world"};
  for (const Communicator* c : mesh.communicators()) named.push_back(c->name());
  for (const CommEvent& e : out.comm_trace.events) {
    if (e.type != CommEvent::Type::kStart || e.seq < out.step_first_seq) continue;
    const std::string& name = out.comm_trace.comms[static_cast<size_t>(e.comm)].name;
    if (std::find(named.begin(), named.end(), name) != named.end()) continue;
    auto it = std::find_if(out.comm.begin(), out.comm.end(), [&](const auto& c) { return c.first == name; });
    if (it == out.comm.end()) {
      out.comm.emplace_back(name, CommStats());
      it = out.comm.end() - 1;
    }
    it->second.record(e.kind, OpTraffic{e.bytes_sent, e.bytes_received});
  }
}

// Prefill (and for kDecode one decode step) of B prompts of S zero tokens.
Status run_generation(const DryRunOptions& o, Mesh& mesh, MemoryTracker& meta, Backend& backend,
                      const EventOrder& order, DryRunResult& out) {
  FP_ASSIGN_OR_RETURN(std::unique_ptr<ShardedDecoder> decoder, make_sharded_decoder(o.config, mesh, o.layout));
  const std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(o.batch),
                                                  std::vector<int32_t>(static_cast<size_t>(o.seq), 0));
  auto prefill = [&]() -> Status { return decoder->prefill(backend, prompts, o.max_new_tokens).status(); };
  if (o.mode == DryRunMode::kPrefill) return measure(meta, mesh, order, out, prefill);
  FP_RETURN_IF_ERROR(prefill());
  const std::vector<int32_t> tokens(static_cast<size_t>(o.batch), 0);
  return measure(meta, mesh, order, out, [&]() -> Status { return decoder->decode(backend, tokens).status(); });
}

}  // namespace

Result<DryRunResult> dry_run(const DryRunOptions& o) {
  FP_RETURN_IF_ERROR(validate_layout(o.config, o.layout, o.batch, o.seq));
  if (o.bf16_native && !o.matmul_takes_bf16)
    return invalid_argument("dry run: bf16_native needs matmul_takes_bf16 (a backend that stores bf16 multiplies it)");
  if (!(o.moe_imbalance >= 1.0) || !std::isfinite(o.moe_imbalance))
    return invalid_argument("--moe-imbalance ({}) must be a finite factor of at least 1", o.moe_imbalance);
  if (o.moe_imbalance > 1.0 && o.config.moe.enabled() && o.config.moe.num_experts_per_tok >= o.config.moe.num_experts)
    return invalid_argument("--moe-imbalance ({}) needs fewer experts per token ({}) than experts ({}): every token "
                            "already goes to every expert",
                            o.moe_imbalance, o.config.moe.num_experts_per_tok, o.config.moe.num_experts);
  FP_ASSIGN_OR_RETURN(MeshLayout mesh_layout, MeshLayout::parse(o.layout.mesh()));
  install_storageless_fault_handler();
  DryRunResult out;
  EventOrder order;
  FP_ASSIGN_OR_RETURN(CountingMesh cm, make_counting_mesh(mesh_layout, o.rank, order, out.comm_trace));
  std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
  MetaBackend meta_backend(MetaBackendOptions{
      .order = &order, .matmul_takes_bf16 = o.matmul_takes_bf16, .moe_imbalance = o.moe_imbalance});
  // Every rank is assumed to hold what this one holds (the same routing): what an
  // all_gather or all_to_all of known integers delivers is known too.
  out.comm_trace.on_exchange = [&meta_backend](const CommOp& op, int rank, int size) {
    meta_backend.deliver_collective(op.kind == CommOpKind::kAllToAll, op.send_buf, op.recv_buf,
                                    op.count * dtype_size(op.dtype), rank, size);
  };
  // bf16 layouts run as train runs them: through the bf16 storage decorator, whose widened
  // copies are the inner backend's copy ops (counted and recorded like any other).
  std::unique_ptr<Backend> bf16 =
      o.layout.dtype == DType::kBF16 && !o.bf16_native ? make_bf16_storage_backend(meta_backend) : nullptr;
  Backend& backend = bf16 ? *bf16 : static_cast<Backend&>(meta_backend);
  {
    ScopedDefaultTracker scope(*meta);
    if (o.mode == DryRunMode::kPrefill || o.mode == DryRunMode::kDecode) {
      FP_RETURN_IF_ERROR(run_generation(o, *cm.mesh, *meta, backend, order, out));
    } else {
      // The micro-batches are refused before anything is built, as the trainer does.
      const int64_t rows = o.batch / o.layout.dp;
      const int64_t micro = o.mode == DryRunMode::kForwardBackward && o.micro_batch > 0 ? o.micro_batch : rows;
      if (micro > rows || rows % micro != 0)
        return invalid_argument("micro-batch ({}) must divide the sequences per data-parallel rank ({} = {} / {})",
                                micro, rows, o.batch, o.layout.dp);
      if (o.mode == DryRunMode::kForwardBackward) FP_RETURN_IF_ERROR(validate_micro_batches(o.layout, rows / micro));
      FP_ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> model,
                          make_sharded_model(o.config, *cm.mesh, o.seq, o.layout));
      std::vector<Batch> locals;
      for (int64_t a = 0; a < rows / micro; ++a) {
        FP_ASSIGN_OR_RETURN(Batch local, storageless_local_batch(*model, micro, o.seq, *meta));
        locals.push_back(std::move(local));
      }
      FP_RETURN_IF_ERROR(measure(*meta, *cm.mesh, order, out, [&] { return run_model_step(o, *model, locals, backend, out); }));
      add_traffic_beside_the_mesh(*cm.mesh, out);
    }
  }
  out.ops = meta_backend.records();
  out.comm_trace.on_exchange = nullptr;  // it names this frame's backend
  return out;
}

namespace {

ComputeEvent compute_event(const OpRecord& r) {
  ComputeEvent e;
  e.op = std::string(r.op);
  e.flops = r.flops;
  e.bytes = static_cast<double>(r.bytes_read + r.bytes_written);
  e.dtype = r.dtype == DType::kBF16 ? MathDType::kBF16 : MathDType::kF32;
  switch (r.shape.kind) {
    case OpShape::Kind::kMatmul:
      e.op_class = ComputeClass::kGemm;
      e.gemm = {r.shape.m, r.shape.n, r.shape.k};
      break;
    case OpShape::Kind::kAttention:
      e.op_class = r.op == "attention_backward" ? ComputeClass::kAttentionBwd : ComputeClass::kAttentionFwd;
      e.attention = {r.shape.batch, r.shape.sq, r.shape.sk, r.shape.n_h, r.shape.d};
      break;
    case OpShape::Kind::kTokenwise:
      e.op_class = r.op == "adamw_update" ? ComputeClass::kOptimizer : ComputeClass::kTokenwise;
      e.tokenwise = {r.shape.rows, r.shape.width};
      break;
  }
  return e;
}

CommKind comm_kind(CommOpKind k) {
  switch (k) {
    case CommOpKind::kBroadcast: return CommKind::kBroadcast;
    case CommOpKind::kReduce: return CommKind::kReduce;
    case CommOpKind::kAllReduce: return CommKind::kAllReduce;
    case CommOpKind::kAllGather:
    case CommOpKind::kAllGatherV: return CommKind::kAllGather;
    case CommOpKind::kReduceScatter:
    case CommOpKind::kReduceScatterV: return CommKind::kReduceScatter;
    case CommOpKind::kAllToAll: return CommKind::kAllToAll;
    case CommOpKind::kSend: return CommKind::kSend;
    case CommOpKind::kRecv: return CommKind::kRecv;
    case CommOpKind::kSendRecv: return CommKind::kSendRecv;
    case CommOpKind::kBarrier: return CommKind::kBarrier;
  }
  return CommKind::kBarrier;
}

}  // namespace

Result<RankTrace> step_timeline_trace(const DryRunResult& r, int rank, int devices_per_node) {
  if (devices_per_node < 1) return invalid_argument("devices per node ({}) must be at least 1", devices_per_node);
  std::vector<LinkClass> links;
  for (const CommTrace::Member& m : r.comm_trace.comms) {
    FP_ASSIGN_OR_RETURN(LinkClass l, link_class(m.world_ranks, devices_per_node));
    links.push_back(l);
  }
  RankTrace t;
  t.rank = rank;
  size_t i = 0, j = 0;
  const std::vector<CommEvent>& ev = r.comm_trace.events;
  while (i < r.ops.size() || j < ev.size()) {
    const bool take_op = j == ev.size() || (i < r.ops.size() && r.ops[i].seq < ev[j].seq);
    if (take_op) {
      const OpRecord& o = r.ops[i++];
      if (o.seq >= r.step_first_seq) t.events.emplace_back(compute_event(o));
      continue;
    }
    const CommEvent& e = ev[j++];
    if (e.seq < r.step_first_seq) continue;
    if (e.type == CommEvent::Type::kComplete) {
      t.events.emplace_back(CommWait{.request = static_cast<int64_t>(e.request)});
      continue;
    }
    const CommTrace::Member& m = r.comm_trace.comms[static_cast<size_t>(e.comm)];
    CommStart s;
    s.request = static_cast<int64_t>(e.request);
    s.kind = comm_kind(e.kind);
    s.communicator = m.name;
    s.comm_size = m.size;
    s.link = links[static_cast<size_t>(e.comm)];
    s.bytes_sent = e.bytes_sent;
    s.bytes_received = e.bytes_received;
    s.blocking = e.blocking;
    s.tag = e.tag;
    // The partners of a send, receive or send_recv by world rank, for simulate_coupled.
    auto world = [&m](int x) {
      return x >= 0 && x < static_cast<int>(m.world_ranks.size()) ? m.world_ranks[static_cast<size_t>(x)] : -1;
    };
    if (e.kind == CommOpKind::kSend || e.kind == CommOpKind::kSendRecv) s.peer = world(e.peer);
    if (e.kind == CommOpKind::kRecv) s.peer = world(e.source);
    if (e.kind == CommOpKind::kSendRecv) s.source = world(e.source);
    if (e.kind != CommOpKind::kSend && e.kind != CommOpKind::kRecv && e.kind != CommOpKind::kSendRecv)
      s.members = m.world_ranks;
    t.events.emplace_back(std::move(s));
  }
  return t;
}

}  // namespace foldpar
