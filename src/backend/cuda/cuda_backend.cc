// CudaBackend: validates every op with backend/op_checks.h, as the CPU backends do, then
// launches cuBLAS or the kernels of backend/cuda/*.cu on the compute stream. Workspace
// (reduction scalars, the RMSNorm weight-gradient partials, attention's delta) is taken
// from the tracked allocator under kWorkspace, so the memory counters stay exact.
#include "backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "backend/cuda/cuda_kernels.h"
#include "backend/op_checks.h"
#include "cuda/cuda_check.h"

#define FP_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                 \
    const cublasStatus_t fp_cublas_rc_ = (call);                                                       \
    if (fp_cublas_rc_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                           \
      ::foldpar::fatal_error(__FILE__, __LINE__, fmt::format("cuBLAS call failed: {}: {} ({})", #call, \
                                                             cublasGetStatusString(fp_cublas_rc_),     \
                                                             static_cast<int>(fp_cublas_rc_)));        \
  } while (0)

namespace foldpar {

namespace cuda {
void check_launch(const char* file, int line) {
  const cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess) [[unlikely]] {
    fatal_error(file, line, fmt::format("CUDA kernel launch failed: {} ({})", cudaGetErrorString(rc), static_cast<int>(rc)));
  }
}
void kernel_contract_violated(const char* file, int line, const char* what) {
  fatal_error(file, line, fmt::format("CUDA launcher called against its contract: {}", what));
}
}  // namespace cuda

namespace {

using cuda::FloatOut;
using cuda::FloatPtr;

void check_cuda_float(const Tensor& t, const char* what) {
  FP_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16, "{}: {} is not f32/bf16 (the CUDA backend has no f64)",
           what, t.describe());
}
FloatPtr in(const Tensor& t, const char* what) {
  check_cuda_float(t, what);
  return {t.raw_data(), t.dtype()};
}
FloatOut out(Tensor& t, const char* what) {
  check_cuda_float(t, what);
  return {t.raw_data(), t.dtype()};
}
const int32_t* ids_of(const Tensor& t) { return static_cast<const int32_t*>(t.raw_data()); }
// An f32 statistic (check_stat first).
float* f32_of(const Tensor& t) { return static_cast<float*>(const_cast<void*>(t.raw_data())); }
void check_stat(const Tensor& t, const char* what) {
  FP_CHECK(t.dtype() == DType::kF32, "{}: {} must be f32 (stat_dtype)", what, t.describe());
}

cudaDataType_t cuda_type(DType t) { return t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

class CudaBackendImpl final : public CudaBackend {
 public:
  explicit CudaBackendImpl(const CudaBackendOptions& options) : options_(options) {
    std::string why;
    const int count = cuda_device_count(&why);
    FP_CHECK(count > 0, "no CUDA device: {}", why);
    FP_CHECK(options.device >= 0 && options.device < count, "CUDA device {} of {}", options.device, count);
    FP_CUDA_CHECK(cudaSetDevice(options.device));
    FP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    FP_CUBLAS_CHECK(cublasCreate(&blas_));
    FP_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
    FP_CUBLAS_CHECK(cublasSetMathMode(blas_, options.allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    check_cuda_memory();
  }
  ~CudaBackendImpl() override {
    (void)cudaStreamSynchronize(stream_);
    (void)cublasDestroy(blas_);
    (void)cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }
  void* stream() const override { return stream_; }
  int device() const override { return options_.device; }
  void synchronize() override { FP_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    // Same dtypes, or bf16 x bf16 into f32 (f32 gradients of bf16 weights, as the CPU backend).
    const bool mixed = a.dtype() == DType::kBF16 && c.dtype() == DType::kF32;
    const MatmulDims d = mixed ? check_matmul_bf16(a, ta, b, tb, c) : check_matmul(a, ta, b, tb, c);
    check_cuda_float(c, "matmul c");
    if (d.m == 0 || d.n == 0) return;
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    const cudaDataType_t ab_type = cuda_type(a.dtype()), c_type = cuda_type(c.dtype());
    const cublasComputeType_t compute =
        a.dtype() == DType::kF32 && options_.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    FP_CUBLAS_CHECK(cublasGemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 static_cast<int>(d.n), static_cast<int>(d.m), static_cast<int>(d.k), &alpha,
                                 b.raw_data(), ab_type, static_cast<int>(d.ldb), a.raw_data(), ab_type,
                                 static_cast<int>(d.lda), &beta, c.raw_data(), c_type, static_cast<int>(d.n), compute,
                                 CUBLAS_GEMM_DEFAULT));
    done();
  }

  void copy(const Tensor& src, Tensor& dst) override {
    check_copy(src, dst);
    if (src.dtype() == dst.dtype()) {
      FP_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), src.nbytes(), cudaMemcpyDefault, stream_));
    } else {
      cuda::launch_convert(in(src, "copy src"), out(dst, "copy dst"), src.numel(), stream_);
    }
    done();
  }
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override {
    if (!check_copy_strided(src, dst, c)) return;
    const cuda::StridedCopyShape s{c.rows, c.cols, c.src.offset, c.src.row_stride, c.dst.offset, c.dst.row_stride};
    cuda::launch_strided_copy(src.raw_data(), dst.raw_data(), dtype_size(src.dtype()), s, stream_);
    done();
  }
  // The host buffer may be released as soon as these return: always synchronous.
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override {
    check_host_copy(dst, src.size(), "copy_from_host");
    dst.count_host_copy(static_cast<int64_t>(src.size()), 0);
    if (src.empty()) return;
    FP_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.data(), src.size(), cudaMemcpyDefault, stream_));
    FP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override {
    check_host_copy(src, dst.size(), "copy_to_host");
    src.count_host_copy(0, static_cast<int64_t>(dst.size()));
    if (dst.empty()) return;
    FP_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.raw_data(), dst.size(), cudaMemcpyDefault, stream_));
    FP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void add_inplace(const Tensor& x, Tensor& y) override {
    FP_CHECK(x.numel() == y.numel() && x.dtype() == y.dtype(), "add_inplace {} into {}", x.describe(), y.describe());
    cuda::launch_add(in(x, "add x"), out(y, "add y"), x.numel(), stream_);
    done();
  }
  void scale_inplace(double alpha, Tensor& y) override {
    cuda::launch_scale(alpha, out(y, "scale y"), y.numel(), stream_);
    done();
  }
  void fill(double value, Tensor& y) override {
    cuda::launch_fill(value, out(y, "fill y"), y.numel(), stream_);
    done();
  }
  double sum_squares(const Tensor& x) override {
    Tensor scratch = Tensor::empty({1}, DType::kF64, MemCategory::kWorkspace);
    return cuda::sum_squares(in(x, "sum_squares x"), x.numel(), scratch.data<double>(), stream_);
  }
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override {
    FP_CHECK(grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
             "adamw shapes {} {} {} {}", grad.describe(), param.describe(), m.describe(), v.describe());
    cuda::launch_adamw(adamw_args(s), in(grad, "adamw grad"), out(param, "adamw param"), out(m, "adamw m"), out(v, "adamw v"),
                       param.numel(), stream_);
    done();
  }

  // The many-tensor ops: one table upload and one launch each (cuda_kernels.h), the same
  // checks per tensor as the single-tensor ops. Workspace is freed when the op returns, as
  // every workspace here: the pool hands it out again only to later work on this stream.
  void fill_many(double value, std::span<Tensor* const> ys) override {
    std::vector<cuda::FillSlot> slots;
    slots.reserve(ys.size());
    for (Tensor* y : ys) slots.push_back({out(*y, "fill_many y"), y->numel()});
    const int64_t count = static_cast<int64_t>(slots.size());
    Tensor table = workspace_bytes(cuda::fill_many_workspace_bytes(count));
    cuda::launch_fill_many(value, slots.data(), count, table.raw_data(), stream_);
    done();
  }
  void sum_squares_many(std::span<const Tensor* const> xs, std::span<double> totals) override {
    FP_CHECK(xs.size() == totals.size(), "sum_squares_many: {} tensors but {} results", xs.size(), totals.size());
    std::vector<cuda::SumSquaresSlot> slots;
    slots.reserve(xs.size());
    for (const Tensor* x : xs) slots.push_back({in(*x, "sum_squares_many x"), x->numel()});
    const int64_t count = static_cast<int64_t>(slots.size());
    Tensor table = workspace_bytes(cuda::sum_squares_many_workspace_bytes(count));
    cuda::sum_squares_many(slots.data(), count, table.raw_data(), totals.data(), stream_);
  }
  void adamw_update_many(const AdamWStep& s, std::span<const AdamWTensors> ts) override {
    std::vector<cuda::AdamWSlot> slots;
    slots.reserve(ts.size());
    for (const AdamWTensors& t : ts) {
      const Tensor &grad = *t.grad, &param = *t.param, &m = *t.m, &v = *t.v;
      FP_CHECK(grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
               "adamw shapes {} {} {} {}", grad.describe(), param.describe(), m.describe(), v.describe());
      cuda::FloatOut rounded{nullptr, DType::kF32};
      if (t.rounded != nullptr) {
        check_copy(param, *t.rounded);
        rounded = out(*t.rounded, "adamw rounded");
      }
      slots.push_back({in(grad, "adamw grad"), out(*t.param, "adamw param"), out(*t.m, "adamw m"),
                       out(*t.v, "adamw v"), param.numel(), t.decay ? static_cast<float>(s.weight_decay) : 0.0f,
                       rounded});
    }
    const int64_t count = static_cast<int64_t>(slots.size());
    Tensor table = workspace_bytes(cuda::adamw_many_workspace_bytes(count));
    cuda::launch_adamw_many(adamw_args(s), slots.data(), count, table.raw_data(), stream_);
    done();
  }

  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t off, Tensor& o) override {
    const int64_t rows = table.dim(0), h = table.dim(1);
    check_i32_vector(ids, rows_of(o), "embedding ids");
    FP_CHECK(o.dim(-1) == h && o.dtype() == table.dtype(), "embedding out {} table {}", o.describe(), table.describe());
    cuda::launch_embedding_forward(ids_of(ids), ids.numel(), in(table, "embedding table"), rows, h, off,
                                   out(o, "embedding out"), stream_);
    done();
  }
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t off, Tensor& d_table) override {
    const int64_t rows = d_table.dim(0), h = d_table.dim(1);
    check_i32_vector(ids, rows_of(d_out), "embedding ids");
    FP_CHECK(d_out.dim(-1) == h, "embedding d_out {} d_table {}", d_out.describe(), d_table.describe());
    cuda::launch_embedding_backward(ids_of(ids), ids.numel(), in(d_out, "embedding d_out"), rows, h, off,
                                    out(d_table, "embedding d_table"), stream_);
    done();
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override {
    check_same(x, y, "rmsnorm y");
    FP_CHECK(w.numel() == x.dim(-1) && rstd.numel() == rows_of(x), "rmsnorm w {} rstd {} x {}", w.describe(),
             rstd.describe(), x.describe());
    cuda::launch_rmsnorm_forward(in(x, "rmsnorm x"), in(w, "rmsnorm w"), eps, rows_of(x), x.dim(-1), out(y, "rmsnorm y"),
                                 out(rstd, "rmsnorm rstd"), stream_);
    done();
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw) override {
    check_same(x, dy, "rmsnorm dy");
    check_same(x, dx, "rmsnorm dx");
    FP_CHECK(dw.numel() == x.dim(-1) && w.numel() == x.dim(-1) && rstd.numel() == rows_of(x),
             "rmsnorm dw {} w {} rstd {}", dw.describe(), w.describe(), rstd.describe());
    Tensor scratch = Tensor::empty({x.dim(-1)}, DType::kF32, MemCategory::kWorkspace);
    cuda::launch_rmsnorm_backward(in(x, "rmsnorm x"), in(w, "rmsnorm w"), in(rstd, "rmsnorm rstd"), in(dy, "rmsnorm dy"),
                                  rows_of(x), x.dim(-1), out(dx, "rmsnorm dx"), out(dw, "rmsnorm dw"),
                                  scratch.data<float>(), stream_);
    done();
  }

  void rope_forward(const Tensor& table, Tensor& x) override { rope(table, x, +1.0f); }
  void rope_backward(const Tensor& table, Tensor& dx) override { rope(table, dx, -1.0f); }

  void attention_forward(const AttentionArgs& args, Tensor& o, Tensor& lse) override {
    const cuda::AttentionShape s = check_cuda_attention(args, o, lse);
    if (attention_kernel(args, {&o}) == AttentionKernel::kTensorCore) {
      Tensor bounds = tile_bounds_workspace(s);
      cuda::launch_attention_forward_tc(s, in(*args.q, "attention q"), in(*args.k, "attention k"),
                                        in(*args.v, "attention v"), ids_of(*args.q_pos), ids_of(*args.k_pos),
                                        out(o, "attention out"), static_cast<float*>(lse.raw_data()),
                                        bounds.data<int32_t>(), stream_);
    } else {
      cuda::launch_attention_forward(s, in(*args.q, "attention q"), in(*args.k, "attention k"),
                                     in(*args.v, "attention v"), ids_of(*args.q_pos), ids_of(*args.k_pos),
                                     out(o, "attention out"), static_cast<float*>(lse.raw_data()), stream_);
    }
    done();
  }
  void attention_backward(const AttentionArgs& args, const Tensor& o, const Tensor& lse, const Tensor& d_out,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    const cuda::AttentionShape s = check_cuda_attention(args, o, lse);
    FP_CHECK(d_out.shape() == o.shape() && dq.shape() == args.q->shape() && dk.shape() == args.k->shape() &&
                 dv.shape() == args.v->shape() && d_out.dtype() == o.dtype() && dq.dtype() == o.dtype() &&
                 dk.dtype() == o.dtype() && dv.dtype() == o.dtype(),
             "attention backward: d_out {} dq {} dk {} dv {}", d_out.describe(), dq.describe(), dk.describe(),
             dv.describe());
    Tensor delta = Tensor::empty({s.batch, s.n_h, s.sq}, DType::kF32, MemCategory::kWorkspace);
    if (attention_kernel(args, {&o, &d_out, &dq, &dk, &dv}) == AttentionKernel::kTensorCore) {
      Tensor bounds = tile_bounds_workspace(s);
      cuda::launch_attention_backward_tc(s, in(*args.q, "attention q"), in(*args.k, "attention k"),
                                         in(*args.v, "attention v"), in(o, "attention out"),
                                         static_cast<const float*>(lse.raw_data()), in(d_out, "attention d_out"),
                                         ids_of(*args.q_pos), ids_of(*args.k_pos), delta.data<float>(),
                                         bounds.data<int32_t>(), out(dq, "dq"), out(dk, "dk"), out(dv, "dv"),
                                         stream_);
    } else {
      cuda::launch_attention_backward(s, in(*args.q, "attention q"), in(*args.k, "attention k"),
                                      in(*args.v, "attention v"), in(o, "attention out"),
                                      static_cast<const float*>(lse.raw_data()), in(d_out, "attention d_out"),
                                      ids_of(*args.q_pos), ids_of(*args.k_pos), delta.data<float>(), out(dq, "dq"),
                                      out(dk, "dk"), out(dv, "dv"), stream_);
    }
    done();
  }

  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& o) override {
    check_same(gate, up, "swiglu up");
    check_same(gate, o, "swiglu out");
    cuda::launch_swiglu_forward(in(gate, "swiglu gate"), in(up, "swiglu up"), out(o, "swiglu out"), gate.numel(),
                                stream_);
    done();
  }
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                       Tensor& d_up) override {
    check_same(gate, up, "swiglu up");
    check_same(gate, d_out, "swiglu d_out");
    check_same(gate, d_gate, "swiglu d_gate");
    check_same(gate, d_up, "swiglu d_up");
    cuda::launch_swiglu_backward(in(gate, "swiglu gate"), in(up, "swiglu up"), in(d_out, "swiglu d_out"),
                                 out(d_gate, "swiglu d_gate"), out(d_up, "swiglu d_up"), gate.numel(), stream_);
    done();
  }

  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore, Tensor& lse) override {
    const int64_t rows = rows_of(logits);
    check_i32_vector(targets, rows, "cross_entropy targets");
    FP_CHECK(lse.numel() == rows, "cross_entropy lse {}", lse.describe());
    check_stat_like(lse, logits, "cross_entropy lse");
    Tensor scratch = Tensor::empty({1}, DType::kF64, MemCategory::kWorkspace);
    return cuda::cross_entropy_forward(in(logits, "cross_entropy logits"), ids_of(targets), rows, logits.dim(-1),
                                       ignore, out(lse, "cross_entropy lse"), scratch.data<double>(), stream_);
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t off,
                              int32_t ignore, double scale, Tensor& d_logits) override {
    const int64_t rows = rows_of(logits);
    check_same(logits, d_logits, "cross_entropy d_logits");
    check_i32_vector(targets, rows, "cross_entropy targets");
    FP_CHECK(lse.numel() == rows, "cross_entropy lse {}", lse.describe());
    cuda::launch_cross_entropy_backward(in(logits, "cross_entropy logits"), ids_of(targets), in(lse, "cross_entropy lse"),
                                        rows, logits.dim(-1), off, ignore, scale, out(d_logits, "d_logits"), stream_);
    done();
  }
  void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t off, int32_t ignore, Tensor& row_max,
                            Tensor& row_sum, Tensor& target_logit) override {
    const int64_t rows = rows_of(logits);
    check_i32_vector(targets, rows, "softmax_chunk_update targets");
    FP_CHECK(row_max.numel() == rows && row_sum.numel() == rows && target_logit.numel() == rows,
             "softmax_chunk_update rows {}", rows);
    cuda::launch_softmax_chunk_update(in(logits, "softmax_chunk_update logits"), ids_of(targets), rows, logits.dim(-1),
                                      off, ignore, out(row_max, "row_max"), out(row_sum, "row_sum"),
                                      out(target_logit, "target_logit"), stream_);
    done();
  }

  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& o, Tensor& lse) override {
    const AttentionMergeDims d = check_attention_merge(block_out, block_lse, o, lse);
    check_stat_like(lse, o, "attention_merge");
    cuda::launch_attention_merge(in(block_out, "attention_merge block_out"), f32_of(block_lse),
                                 out(o, "attention_merge out"), f32_of(lse), d.batch, d.sq, d.n_h, d.d, stream_);
    done();
  }
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override {
    const int64_t n = check_softmax_rescale(local_max, global_max, row_sum);
    check_stat(row_sum, "softmax_rescale row_sum");
    cuda::launch_softmax_rescale(f32_of(local_max), f32_of(global_max), f32_of(row_sum), n, stream_);
    done();
  }
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                const Tensor& targets, int32_t ignore, Tensor& lse) override {
    const int64_t n = check_cross_entropy_finish(row_max, row_sum, target_logit, targets, lse);
    check_stat(lse, "cross_entropy_finish lse");
    Tensor scratch = Tensor::empty({2}, DType::kF64, MemCategory::kWorkspace);
    cuda::cross_entropy_finish(f32_of(row_max), f32_of(row_sum), f32_of(target_logit), ids_of(targets), ignore,
                               f32_of(lse), n, scratch.data<double>(), stream_);
    double sums[2] = {0, 0};
    FP_CUDA_CHECK(cudaMemcpy(sums, scratch.raw_data(), sizeof(sums), cudaMemcpyDefault));
    return LossSums{sums[0], static_cast<int64_t>(sums[1])};
  }
  // The MoE ops have no CUDA kernels yet: a MoE model on this backend stops here by name.
  [[noreturn]] static void no_moe_kernel(const char* op) {
    FP_CHECK(false, "cuda backend: {} (mixture of experts) is not implemented on CUDA; run MoE models on the CPU",
             op);
    __builtin_unreachable();
  }
  void moe_route_forward(const Tensor&, bool, Tensor&, Tensor&, Tensor&) override {
    no_moe_kernel("moe_route_forward");
  }
  void moe_route_backward(const MoeRouteGrad&, Tensor&) override { no_moe_kernel("moe_route_backward"); }
  void gather_rows(const Tensor&, const Tensor&, const Tensor*, Tensor&) override { no_moe_kernel("gather_rows"); }
  void scatter_add_rows(const Tensor&, const Tensor&, const Tensor*, Tensor&) override {
    no_moe_kernel("scatter_add_rows");
  }
  void rows_dot(const Tensor&, const Tensor&, Tensor&) override { no_moe_kernel("rows_dot"); }
  void sigmoid_forward(const Tensor&, Tensor&) override { no_moe_kernel("sigmoid_forward"); }
  void sigmoid_backward(const Tensor&, const Tensor&, Tensor&) override { no_moe_kernel("sigmoid_backward"); }

  int64_t count_valid_targets(const Tensor& targets, int32_t ignore) override {
    check_targets(targets);
    Tensor scratch = Tensor::empty({1}, DType::kI64, MemCategory::kWorkspace);
    return cuda::count_valid_targets(ids_of(targets), targets.numel(), ignore,
                                     static_cast<unsigned long long*>(scratch.raw_data()), stream_);
  }

 private:
  // Kernels read tensors through their pointers: with plain host memory under the tracker
  // the first op would fail with an illegal address far from the cause.
  static void check_cuda_memory() {
    const Tensor probe = Tensor::empty({1}, DType::kF32, MemCategory::kWorkspace);
    cudaPointerAttributes attr{};
    FP_CUDA_CHECK(cudaPointerGetAttributes(&attr, probe.raw_data()));
    FP_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeHost,
             "the CUDA backend needs tensors in CUDA memory: call use_cuda_memory(MemoryTracker::process()) "
             "before the first tensor is allocated");
  }
  static cuda::AdamWArgs adamw_args(const AdamWStep& s) {
    return {static_cast<float>(s.lr),
            static_cast<float>(s.beta1),
            static_cast<float>(s.beta2),
            static_cast<float>(s.eps),
            static_cast<float>(s.weight_decay),
            static_cast<float>(s.grad_scale),
            static_cast<float>(1.0 - std::pow(s.beta1, static_cast<double>(s.step))),
            static_cast<float>(1.0 - std::pow(s.beta2, static_cast<double>(s.step)))};
  }
  // At least `bytes` of device workspace, aligned as every block is (MemoryTracker::kAlignment).
  static Tensor workspace_bytes(size_t bytes) {
    return Tensor::empty({std::max<int64_t>(1, static_cast<int64_t>((bytes + 7) / 8))}, DType::kI64,
                         MemCategory::kWorkspace);
  }
  void done() {
    if (options_.sync_each_op) FP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  // Statistics next to f32 activations are f32; next to bf16 ones f32 too (stat_dtype).
  static void check_stat_like(const Tensor& stat, const Tensor& like, const char* what) {
    check_cuda_float(like, what);
    check_stat(stat, what);
  }
  void rope(const Tensor& table, Tensor& x, float sign) {
    FP_CHECK(x.rank() == 4 && table.rank() == 3 && table.dim(0) == x.dim(1) && table.dim(1) == 2 &&
                 table.dim(2) * 2 == x.dim(3),
             "rope: x {} table {}", x.describe(), table.describe());
    cuda::launch_rope(in(table, "rope table"), out(x, "rope x"), x.dim(0), x.dim(1), x.dim(2), x.dim(3), sign, stream_);
    done();
  }
  // The attention kernel for these operands (q, k, v and `more`): options_.attention resolved.
  AttentionKernel attention_kernel(const AttentionArgs& args, std::initializer_list<const Tensor*> more) const {
    bool aligned = true;
    for (const Tensor* t : {args.q, args.k, args.v}) aligned = aligned && aligned16(*t);
    for (const Tensor* t : more) aligned = aligned && aligned16(*t);
    return resolve_attention_kernel(options_.attention, args.q->dtype(), args.q->dim(3), aligned);
  }
  static bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; }
  static Tensor tile_bounds_workspace(const cuda::AttentionShape& s) {
    return Tensor::empty({std::max<int64_t>(1, cuda::attention_tc_workspace_words(s))}, DType::kI32,
                         MemCategory::kWorkspace);
  }
  // check_attention, except that lse is f32 for bf16 activations (stat_dtype).
  static cuda::AttentionShape check_cuda_attention(const AttentionArgs& args, const Tensor& o, const Tensor& lse) {
    FP_CHECK(args.q && args.k && args.v && args.q_pos && args.k_pos, "attention: missing argument");
    const Tensor &q = *args.q, &k = *args.k, &v = *args.v;
    FP_CHECK(q.rank() == 4 && k.rank() == 4 && v.rank() == 4, "attention ranks {} {} {}", q.describe(), k.describe(),
             v.describe());
    const cuda::AttentionShape s{q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3), static_cast<float>(args.scale),
                                 args.window};
    FP_CHECK(k.shape() == v.shape() && k.dim(0) == s.batch && k.dim(3) == s.d, "attention k {} v {} q {}",
             k.describe(), v.describe(), q.describe());
    FP_CHECK(s.n_kv > 0 && s.n_h > 0 && s.n_h % s.n_kv == 0, "attention heads {} not a multiple of kv heads {}", s.n_h,
             s.n_kv);
    FP_CHECK(s.d <= cuda::kMaxHeadDim, "attention head dim {} exceeds the CUDA kernel's {}", s.d, cuda::kMaxHeadDim);
    FP_CHECK(args.window >= 0, "attention window {} must be 0 (off) or positive", args.window);
    FP_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype() && o.dtype() == q.dtype(), "attention dtypes");
    check_cuda_float(q, "attention q");
    check_stat(lse, "attention lse");
    FP_CHECK(o.shape() == q.shape(), "attention out {} vs q {}", o.describe(), q.describe());
    FP_CHECK(lse.numel() == s.batch * s.n_h * s.sq, "attention lse {} for B={} n_h={} Sq={}", lse.describe(), s.batch,
             s.n_h, s.sq);
    check_i32_vector(*args.q_pos, s.sq, "attention q_pos");
    check_i32_vector(*args.k_pos, s.sk, "attention k_pos");
    return s;
  }

  CudaBackendOptions options_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
};

}  // namespace

int cuda_device_count(std::string* why) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    if (why != nullptr) *why = fmt::format("cudaGetDeviceCount failed: {}", cudaGetErrorString(rc));
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "cudaGetDeviceCount found no device";
  return count;
}

AttentionKernel resolve_attention_kernel(AttentionKernel requested, DType dtype, int64_t d, bool aligned16) {
  cuda::AttentionShape shape{};
  shape.d = d;
  const bool supported = cuda::attention_tc_supported(shape, dtype) && aligned16;
  switch (requested) {
    case AttentionKernel::kSimple:
      return AttentionKernel::kSimple;
    case AttentionKernel::kTensorCore:
      FP_CHECK(supported,
               "attention: the tensor-core kernel (CudaBackendOptions::attention = kTensorCore) needs bf16, d in "
               "{{64, 128}} and 16-byte aligned tensors; got {}, d = {}, aligned = {}",
               dtype_name(dtype), d, aligned16);
      return AttentionKernel::kTensorCore;
    case AttentionKernel::kAuto:
      break;
  }
  return supported ? AttentionKernel::kTensorCore : AttentionKernel::kSimple;
}

std::unique_ptr<CudaBackend> make_cuda_backend(const CudaBackendOptions& options) {
  return std::make_unique<CudaBackendImpl>(options);
}

}  // namespace foldpar
