// The NCCL backend of Communicator: one rank per GPU. The ncclUniqueId is broadcast over
// the host communicator (MPI) as 32 i32 words; each operation is enqueued on the transfer
// stream after an event recorded on the compute stream, and an event recorded after it
// completes the request. Host-only buffers are staged through device memory first. Every
// enqueued operation is registered with the communicator's watchdog (device_watchdog.h),
// which polls its event and ncclCommGetAsyncError, so a dead peer ends the job with a
// report instead of a hang.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <memory>
#include <vector>

#include "comm/nccl/device_communicator.h"
#include "comm/nccl/device_watchdog.h"
#include "comm/nccl/staging.h"
#include "cuda/cuda_check.h"

namespace foldpar {
namespace {

// A failed NCCL call is a library failure: abort the whole job so no peer hangs.
#define FP_NCCL_CHECK(call)                                                                          \
  do {                                                                                               \
    const ncclResult_t fp_nccl_rc_ = (call);                                                         \
    if (fp_nccl_rc_ != ncclSuccess) [[unlikely]]                                                     \
      ::foldpar::fatal_error(__FILE__, __LINE__, fmt::format("NCCL call failed: {}: {} ({})", #call, \
                                                             ncclGetErrorString(fp_nccl_rc_),        \
                                                             static_cast<int>(fp_nccl_rc_)));        \
  } while (0)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

// Whether the GPU can address p (device, managed or registered host memory).
bool device_addressable(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged || attr.type == cudaMemoryTypeHost;
}

// Pinned host memory (GPU tests' tensors): the host may read it right after wait().
bool host_memory(const void* p) {
  cudaPointerAttributes attr{};
  if (p == nullptr || cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

const char* at(const void* base, size_t elems, DType t) { return static_cast<const char*>(base) + elems * dtype_size(t); }
char* at(void* base, size_t elems, DType t) { return static_cast<char*>(base) + elems * dtype_size(t); }

// An event shared by the request and the watchdog's registry, destroyed with the last.
using SharedEvent = std::shared_ptr<CUevent_st>;
SharedEvent make_event() {
  cudaEvent_t e = nullptr;
  FP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return SharedEvent(e, [](cudaEvent_t x) { (void)cudaEventDestroy(x); });
}
// Done, or failed (the error surfaces where the event is synchronized): anything but not-ready.
bool event_passed(const SharedEvent& e) { return cudaEventQuery(e.get()) != cudaErrorNotReady; }

// Completes when the transfer stream has passed `done`. wait() makes the compute stream wait
// for it (cudaStreamWaitEvent: kernels enqueued after wait() see the received data, and the
// host goes on), unless the host itself must see the result: no compute stream to order,
// or a host-only buffer that the transfer stream copies back into. The host then polls the
// event through the watchdog, which ends the wait if the operation never completes.
class NcclRequest final : public CommRequestImpl {
 public:
  NcclRequest(SharedEvent done, cudaStream_t compute, bool host_reads, nccl_detail::DeviceWatchdog& watchdog)
      : done_(std::move(done)), compute_(compute), host_reads_(host_reads), watchdog_(watchdog) {}
  Status wait() override {
    if (compute_ == nullptr || host_reads_) {
      const SharedEvent& e = done_;
      FP_RETURN_IF_ERROR(watchdog_.wait_host([&e] { return event_passed(e); }));
      FP_CUDA_CHECK(cudaEventSynchronize(done_.get()));  // completed: returns at once, or names the CUDA error
    } else {
      FP_CUDA_CHECK(cudaStreamWaitEvent(compute_, done_.get(), 0));
    }
    return Status::ok_status();
  }
  Status test(bool* done) override {
    const cudaError_t rc = cudaEventQuery(done_.get());
    if (rc == cudaErrorNotReady) {
      *done = false;
      return Status::ok_status();
    }
    FP_CUDA_CHECK(rc);
    *done = true;
    return Status::ok_status();
  }

 private:
  SharedEvent done_;
  cudaStream_t compute_;
  bool host_reads_;
  nccl_detail::DeviceWatchdog& watchdog_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& host, std::unique_ptr<Communicator> owned_host, const DeviceCommOptions& options)
      : Communicator(host.rank(), host.size(), host.name(), host.world_ranks()),
        host_(host),
        owned_host_(std::move(owned_host)),
        options_(options),
        compute_(static_cast<cudaStream_t>(options.compute_stream)) {
    FP_CUDA_CHECK(cudaSetDevice(options.device));
    ncclUniqueId id{};
    static_assert(sizeof(id) % 4 == 0);
    if (host_.rank() == 0) FP_NCCL_CHECK(ncclGetUniqueId(&id));
    FP_CHECK_OK(host_.broadcast(&id, sizeof(id) / 4, DType::kI32, 0));
    FP_NCCL_CHECK(ncclCommInitRank(&comm_, size(), id, rank()));
    FP_CUDA_CHECK(cudaStreamCreateWithFlags(&transfer_, cudaStreamNonBlocking));
    FP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    nccl_detail::DeviceWatchdogHooks hooks;
    hooks.async_error = [this]() -> std::string {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return "ncclCommGetAsyncError failed";
      if (state == ncclSuccess || state == ncclInProgress) return "";
      const char* last = ncclGetLastError(comm_);
      return fmt::format("{} ({}){}", ncclGetErrorString(state), static_cast<int>(state),
                         last != nullptr && *last != 0 ? fmt::format(": {}", last) : std::string());
    };
    hooks.abort = [this] {
      aborted_.store(true);
      (void)ncclCommAbort(comm_);
    };
    hooks.fail = [](const std::string& report) { fatal_error(__FILE__, __LINE__, report); };
    watchdog_ = std::make_unique<nccl_detail::DeviceWatchdog>(host_.name(), rank(), size(), options_.timeout_s,
                                                              std::move(hooks));
  }
  ~NcclCommunicator() override {
    watchdog_.reset();  // its thread stops before the communicator goes
    if (aborted_.load()) return;  // the watchdog's report is ending the process
    (void)cudaStreamSynchronize(transfer_);
    (void)ncclCommDestroy(comm_);
    (void)cudaEventDestroy(ready_);
    (void)cudaStreamDestroy(transfer_);
  }

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    std::unique_ptr<Communicator> part = host_.split(color, key, std::move(name));
    Communicator& ref = *part;
    return std::make_unique<NcclCommunicator>(ref, std::move(part), options_);
  }

 protected:
  // NCCL matches point-to-point operations in call order: a tagged stream cannot be honoured.
  Status supports(const CommOp& op) const override {
    if (op.tag != 0) return unimplemented("NCCL has no message tags (tag {})", op.tag);
    return Status::ok_status();
  }

  Status run_validated(const CommOp& op) override { return start_validated(op).wait(); }

  CommRequest start_validated(const CommOp& op) override {
    FP_CUDA_CHECK(cudaSetDevice(options_.device));
    const cudaStream_t stream = stream_of(op);
    order_after_compute(stream);
    CommOp staged_op = op;
    std::vector<void*> scratch;
    const nccl_detail::Stager stager{
        [](const void* p) { return !device_addressable(p); },
        [&](size_t bytes) {
          void* p = nullptr;
          FP_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
          scratch.push_back(p);
          return static_cast<char*>(p);
        },
        [&](void* dst, const void* src, size_t bytes) {
          FP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
        }};
    const nccl_detail::StagedRange back = nccl_detail::stage(staged_op, rank(), size(), stager);
    enqueue(staged_op, stream);
    if (back.bytes > 0) FP_CUDA_CHECK(cudaMemcpyAsync(back.user, back.staged, back.bytes, cudaMemcpyDefault, stream));
    for (void* p : scratch) FP_CUDA_CHECK(cudaFreeAsync(p, stream));
    SharedEvent done = make_event();
    FP_CUDA_CHECK(cudaEventRecord(done.get(), stream));
    watchdog_->begin(op, [done] { return event_passed(done); });
    const bool host_reads = !scratch.empty() || stream == compute_ || host_memory(op.recv_buf);
    return CommRequest(std::make_unique<NcclRequest>(std::move(done), compute_, host_reads, *watchdog_));
  }

  // One NCCL group (one launch) when the ops share a stream and none needs staging; one by
  // one otherwise. Every request completes with the group's event.
  std::vector<CommRequest> start_validated_group(std::span<const CommOp> ops) override {
    const cudaStream_t stream = stream_of(ops[0]);
    bool grouped = ops.size() > 1;
    for (const CommOp& op : ops)
      grouped = grouped && stream_of(op) == stream && !nccl_detail::needs_staging(op, rank(), size(), [](const void* p) {
        return !device_addressable(p);
      });
    if (!grouped) return Communicator::start_validated_group(ops);
    FP_CUDA_CHECK(cudaSetDevice(options_.device));
    order_after_compute(stream);
    FP_NCCL_CHECK(ncclGroupStart());
    for (const CommOp& op : ops) enqueue(op, stream);
    FP_NCCL_CHECK(ncclGroupEnd());
    SharedEvent done = make_event();
    FP_CUDA_CHECK(cudaEventRecord(done.get(), stream));
    std::vector<CommRequest> requests;
    for (const CommOp& op : ops) {
      watchdog_->begin(op, [done] { return event_passed(done); });
      const bool host_reads = stream == compute_ || host_memory(op.recv_buf);
      requests.emplace_back(std::make_unique<NcclRequest>(done, compute_, host_reads, *watchdog_));
    }
    return requests;
  }

 private:
  cudaStream_t stream_of(const CommOp& op) const {
    return op.stream.native != nullptr ? static_cast<cudaStream_t>(op.stream.native) : transfer_;
  }
  // Transfers start after the compute enqueued so far.
  void order_after_compute(cudaStream_t stream) {
    if (compute_ == nullptr || stream == compute_) return;
    FP_CUDA_CHECK(cudaEventRecord(ready_, compute_));
    FP_CUDA_CHECK(cudaStreamWaitEvent(stream, ready_, 0));
  }

  void enqueue(const CommOp& op, cudaStream_t s) {
    const ncclDataType_t t = nccl_type(op.dtype);
    const ncclRedOp_t r = nccl_op(op.reduce_op);
    switch (op.kind) {
      case CommOpKind::kBroadcast:
        FP_NCCL_CHECK(ncclBroadcast(op.recv_buf, op.recv_buf, op.count, t, op.root, comm_, s));
        return;
      case CommOpKind::kReduce:
        FP_NCCL_CHECK(ncclReduce(op.send_buf, op.recv_buf, op.count, t, r, op.root, comm_, s));
        return;
      case CommOpKind::kAllReduce:
        FP_NCCL_CHECK(ncclAllReduce(op.send_buf, op.recv_buf, op.count, t, r, comm_, s));
        return;
      case CommOpKind::kAllGather:
        FP_NCCL_CHECK(ncclAllGather(op.send_buf, op.recv_buf, op.count, t, comm_, s));
        return;
      case CommOpKind::kReduceScatter:
        FP_NCCL_CHECK(ncclReduceScatter(op.send_buf, op.recv_buf, op.count, t, r, comm_, s));
        return;
      case CommOpKind::kAllGatherV:
      case CommOpKind::kReduceScatterV:
        return enqueue_v(op, s);
      case CommOpKind::kAllToAll:
        FP_NCCL_CHECK(ncclGroupStart());
        for (int p = 0; p < size(); ++p) {
          FP_NCCL_CHECK(ncclSend(at(op.send_buf, p * op.count, op.dtype), op.count, t, p, comm_, s));
          FP_NCCL_CHECK(ncclRecv(at(op.recv_buf, p * op.count, op.dtype), op.count, t, p, comm_, s));
        }
        FP_NCCL_CHECK(ncclGroupEnd());
        return;
      case CommOpKind::kSend:
        FP_NCCL_CHECK(ncclSend(op.send_buf, op.count, t, op.peer, comm_, s));
        return;
      case CommOpKind::kRecv:
        FP_NCCL_CHECK(ncclRecv(op.recv_buf, op.count, t, op.source, comm_, s));
        return;
      case CommOpKind::kSendRecv:
        FP_NCCL_CHECK(ncclGroupStart());
        FP_NCCL_CHECK(ncclSend(op.send_buf, op.count, t, op.peer, comm_, s));
        FP_NCCL_CHECK(ncclRecv(op.recv_buf, op.count, t, op.source, comm_, s));
        FP_NCCL_CHECK(ncclGroupEnd());
        return;
      case CommOpKind::kBarrier: {
        void* word = nullptr;
        FP_CUDA_CHECK(cudaMallocAsync(&word, sizeof(int32_t), s));
        FP_CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(int32_t), s));
        FP_NCCL_CHECK(ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm_, s));
        FP_CUDA_CHECK(cudaFreeAsync(word, s));
        return;
      }
    }
  }

  // The _v forms as one group of rooted operations: a broadcast (all_gather_v) or a reduce
  // (reduce_scatter_v) per block.
  void enqueue_v(const CommOp& op, cudaStream_t s) {
    const ncclDataType_t t = nccl_type(op.dtype);
    FP_NCCL_CHECK(ncclGroupStart());
    size_t offset = 0;
    for (int p = 0; p < size(); ++p) {
      const size_t n = op.counts[p];
      if (op.kind == CommOpKind::kAllGatherV) {
        const void* src = p == rank() ? op.send_buf : at(op.recv_buf, offset, op.dtype);
        FP_NCCL_CHECK(ncclBroadcast(src, at(op.recv_buf, offset, op.dtype), n, t, p, comm_, s));
      } else {
        void* dst = p == rank() ? op.recv_buf : nullptr;
        FP_NCCL_CHECK(ncclReduce(at(op.send_buf, offset, op.dtype), dst, n, t, nccl_op(op.reduce_op), p, comm_, s));
      }
      offset += n;
    }
    FP_NCCL_CHECK(ncclGroupEnd());
  }

  Communicator& host_;
  std::unique_ptr<Communicator> owned_host_;
  DeviceCommOptions options_;
  cudaStream_t compute_ = nullptr;
  cudaStream_t transfer_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborted_{false};
  std::unique_ptr<nccl_detail::DeviceWatchdog> watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, const DeviceCommOptions& options) {
  return std::make_unique<NcclCommunicator>(host, nullptr, options);
}

}  // namespace foldpar
