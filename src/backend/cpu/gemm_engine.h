// The CPU backend's GEMM engines and the choice between them. oneDNN's matmul primitive
// dispatches by instruction set (it JIT-compiles for the ISA it finds), OpenBLAS by CPU
// model (an unknown model falls back to its SSE3 "Prescott" kernels, 5x slower on AVX-512
// machines), and the skinny kernel streams the weights once for decode's few rows. Which
// one runs a product is decided here, from the shape class and the start-up self-check
// (gemm_engine_report); the table behind the choice is in docs/PERFORMANCE.md.
// Not here: argument validation (backend/op_checks.h) and everything that is not a GEMM.
#pragma once

#include <cstdint>
#include <string>

#include "backend/op_checks.h"
#include "tensor/dtype.h"

namespace foldpar {

enum class GemmEngine {
  kAuto,      // the routing table below
  kOneDnn,    // oneDNN matmul primitive, cached per shape (m, k not multiples of 64: left to run time)
  kOpenBlas,  // cblas_sgemm
  kSkinny,    // streamed dot products / row updates, only !trans_a with few rows
};
const char* gemm_engine_name(GemmEngine e);

// What the libraries chose on this machine, found once at first use (process-wide, as the
// libraries' own dispatch is).
struct GemmEngineReport {
  std::string cpu_isa;        // best vector ISA of this CPU (cpuid): "avx512_bf16", "avx2", ...
  std::string onednn_isa;     // dnnl_get_effective_cpu_isa(): "avx512_core_amx", ...
  std::string openblas_core;  // openblas_get_corename(): "Cooperlake", "Prescott", ...
  bool openblas_matches_cpu = false;  // OpenBLAS's kernels use the CPU's widest vectors
  bool bf16_native = false;   // oneDNN multiplies bf16 with bf16 instructions (AVX512_BF16/AMX)
  std::string f32_engine;     // what f32 products of 5+ rows run on: "openblas" or "onednn"
  // Where OpenBLAS's core is slower than the CPU allows: the setting that fixes it
  // ("OPENBLAS_CORETYPE=Cooperlake"). Not needed for speed: such an OpenBLAS gets no GEMMs.
  std::string openblas_fix;
  // Empty, or one line naming what runs below the machine's rate and the fix (oneDNN held
  // below the CPU's ISA, e.g. by DNNL_MAX_CPU_ISA), for the program to print once.
  std::string warning;
  // "gemm onednn (onednn isa avx512_core_amx), openblas core Prescott (slow for this cpu:
  // unused; OPENBLAS_CORETYPE=Cooperlake would fix it), bf16 native, cpu avx512_bf16+amx_bf16":
  // what `foldpar bench` prints and metrics.jsonl records.
  std::string summary() const;
};
const GemmEngineReport& gemm_engine_report();

// The engine kAuto picks for an f32 product of these dims (never kAuto).
GemmEngine choose_f32_engine(const MatmulDims& d, bool trans_a, bool trans_b);

// c [m, n] (row-major, ld n) = alpha op(a) op(b) + beta c, f32; dims from check_matmul, all
// extents > 0. With beta == 0 c is written (old contents, NaN too, ignored). kSkinny
// requires !trans_a.
void gemm_f32(GemmEngine engine, const MatmulDims& d, bool trans_a, bool trans_b, const float* a,
              const float* b, float* c, float alpha, float beta);

// c [m, n] = alpha op(a) op(b) + beta c, f32, row-major with leading dimensions (the
// attention kernel's tiles, which read Q, K and V in place): OpenBLAS where its core uses
// the CPU's widest vectors, oneDNN's sgemm (which dispatches by ISA) where it does not.
void gemm_f32_strided(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// The same with bf16 a and b, products accumulated in f32 and c of dtype c_dtype (kF32 or
// kBF16; a bf16 c is read widened when beta != 0 and rounded once). Runs on oneDNN;
// callers ask bf16_native() first, elsewhere oneDNN may emulate slowly.
void gemm_bf16(const MatmulDims& d, bool trans_a, bool trans_b, const bf16* a, const bf16* b, DType c_dtype,
               void* c, float alpha, float beta);

// Threads oneDNN and OpenBLAS may use (process-wide, as both libraries' settings are).
void set_gemm_threads(int threads);

// The oneDNN implementation chosen for a product ("brg:avx512_core_amx", "gemm:jit", ...),
// for benchmarks that want to show it.
std::string onednn_impl_name(const MatmulDims& d, bool trans_a, bool trans_b, DType ab_dtype, DType c_dtype,
                             float beta = 0.0f);

// How many oneDNN matmul primitives this process has built (each a JIT compilation): one
// per shape whose varying extents (m, k) are multiples of 64, one per family (the other
// dims, transposes, types, alpha, beta) for all the rest.
int64_t onednn_primitives_built();

}  // namespace foldpar
