// GEMM engines (oneDNN matmul, OpenBLAS sgemm, the skinny decode kernel), the routing
// between them and the start-up self-check that tells which kernels each library chose.
#include "backend/cpu/gemm_engine.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "core/check.h"

extern "C" char* openblas_get_corename(void);
extern "C" int openblas_get_num_threads(void);

namespace foldpar {
namespace {

// ---- the CPU, as cpuid and the OS see it ----

// Vector ISA levels, comparable across libraries: 1 SSE, 2 AVX, 3 AVX2+FMA, 4 AVX-512.
constexpr int kLevelSse = 1, kLevelAvx = 2, kLevelAvx2 = 3, kLevelAvx512 = 4;

struct CpuIsa {
  int level = 0;
  bool avx512_bf16 = false, amx_bf16 = false;
  std::string name;
};

CpuIsa detect_cpu_isa() {
  CpuIsa c;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, cx = 0, d = 0;
  __cpuid(1, a, b, cx, d);
  const bool osxsave = cx & (1u << 27), avx = cx & (1u << 28), fma = cx & (1u << 12);
  // Registers the OS saves (XCR0): 0x6 the SSE and AVX state, 0xe0 the AVX-512 state.
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  const bool os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
  unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
  __cpuid_count(7, 0, a, b7, c7, d7);
  __cpuid_count(7, 1, a71, b, cx, d);
  const bool avx2 = b7 & (1u << 5);
  const bool avx512 = (b7 & (1u << 16)) && (b7 & (1u << 17)) && (b7 & (1u << 30)) && (b7 & (1u << 31));  // f dq bw vl
  c.level = kLevelSse;
  if (avx && os_avx) c.level = kLevelAvx;
  if (c.level == kLevelAvx && avx2 && fma) c.level = kLevelAvx2;
  if (c.level == kLevelAvx2 && avx512 && os_avx512) c.level = kLevelAvx512;
  c.avx512_bf16 = c.level == kLevelAvx512 && (a71 & (1u << 5));
  c.amx_bf16 = d7 & (1u << 22);
  static const char* names[] = {"unknown", "sse", "avx", "avx2", "avx512"};
  c.name = c.avx512_bf16 ? "avx512_bf16" : names[c.level];
  if (c.amx_bf16) c.name += "+amx_bf16";
#else
  c.name = "non-x86";
#endif
  return c;
}

// OpenBLAS core names by the widest vectors their kernels use (0: not known here).
int openblas_core_level(std::string core) {
  std::transform(core.begin(), core.end(), core.begin(), [](unsigned char ch) { return std::tolower(ch); });
  static const std::map<std::string, int> levels = {
      {"prescott", kLevelSse},   {"core2", kLevelSse},        {"penryn", kLevelSse},
      {"dunnington", kLevelSse}, {"nehalem", kLevelSse},      {"atom", kLevelSse},
      {"barcelona", kLevelSse},  {"bobcat", kLevelSse},       {"sandybridge", kLevelAvx},
      {"bulldozer", kLevelAvx},  {"piledriver", kLevelAvx},   {"steamroller", kLevelAvx},
      {"excavator", kLevelAvx2}, {"haswell", kLevelAvx2},     {"zen", kLevelAvx2},
      {"skylakex", kLevelAvx512}, {"cooperlake", kLevelAvx512}, {"sapphirerapids", kLevelAvx512}};
  const auto it = levels.find(core);
  return it == levels.end() ? 0 : it->second;
}

// The OPENBLAS_CORETYPE that suits a CPU of this ISA.
const char* openblas_core_for(const CpuIsa& c) {
  if (c.avx512_bf16) return "Cooperlake";
  if (c.level == kLevelAvx512) return "SkylakeX";
  if (c.level == kLevelAvx2) return "Haswell";
  return "Sandybridge";
}

const char* onednn_isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx512_mic: return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    default: return "unknown";
  }
}

int onednn_isa_level(dnnl_cpu_isa_t isa) {
  const unsigned v = static_cast<unsigned>(isa);  // each ISA's value holds the bits of those it extends
  if ((v & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core) return kLevelAvx512;
  if ((v & dnnl_cpu_isa_avx2) == dnnl_cpu_isa_avx2) return kLevelAvx2;
  if ((v & dnnl_cpu_isa_avx) == dnnl_cpu_isa_avx) return kLevelAvx;
  return kLevelSse;
}

struct EngineState {
  GemmEngineReport report;
  bool openblas_ok = false;  // OpenBLAS may take the shape classes where it measured faster
};

// OpenBLAS and oneDNN both use all cores unless told; OPENBLAS_NUM_THREADS=1 (the setting
// for ranks sharing cores) must bind oneDNN too, so without OMP_NUM_THREADS oneDNN's
// OpenMP gets OpenBLAS's count.
void align_onednn_threads() {
  if (std::getenv("OMP_NUM_THREADS") == nullptr) omp_set_num_threads(std::max(1, openblas_get_num_threads()));
}

EngineState make_engine_state() {
  align_onednn_threads();
  EngineState s;
  GemmEngineReport& r = s.report;
  const CpuIsa cpu = detect_cpu_isa();
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  r.cpu_isa = cpu.name;
  r.onednn_isa = onednn_isa_name(isa);
  const char* core = openblas_get_corename();
  r.openblas_core = core != nullptr ? core : "unknown";
  const int blas_level = openblas_core_level(r.openblas_core);
  r.openblas_matches_cpu = cpu.level > 0 && blas_level >= cpu.level;
  const unsigned bf16_bits = dnnl_cpu_isa_avx512_core_bf16;
  r.bf16_native = (static_cast<unsigned>(isa) & bf16_bits) == bf16_bits;
  s.openblas_ok = r.openblas_matches_cpu;
  r.f32_engine = s.openblas_ok ? "openblas" : "onednn";
  if (onednn_isa_level(isa) < cpu.level)
    r.warning = fmt::format(
        "oneDNN runs its {} kernels on a CPU with {} (is DNNL_MAX_CPU_ISA set?): GEMMs run below this "
        "machine's rate; unset DNNL_MAX_CPU_ISA",
        r.onednn_isa, r.cpu_isa);
  if (!r.openblas_matches_cpu) r.openblas_fix = fmt::format("OPENBLAS_CORETYPE={}", openblas_core_for(cpu));
  return s;
}

const EngineState& engine_state() {
  static const EngineState s = make_engine_state();
  return s;
}

// ---- oneDNN: one engine and stream, primitives cached by everything they are built from ----

// Building a matmul primitive costs 0.2-2 ms here (oneDNN JIT-compiles a kernel for the
// shape), as much as running a [300 x 512] x [512 x 512] product. The products of a dense
// step repeat every step, but a MoE expert's rows (its share of the routed tokens) and a
// prompt's length change from call to call, and a primitive per new extent cost a MoE
// training step a quarter of its time. So an extent that can vary, m (rows) or k (the rows
// a weight gradient sums over), is fixed in the primitive only where it is a multiple of
// kFixedExtent, as a model's token counts are; any other is left to run time
// (DNNL_RUNTIME_DIM_VAL: oneDNN's gemm kernel, built once for all of them, as fast as the
// specialized one at these sizes in f32; docs/PERFORMANCE.md). The choice is a function of
// the shape alone, so a product gives the same bits whatever ran before it.
constexpr int64_t kFixedExtent = 64;
bool runtime_extent(int64_t x) { return x % kFixedExtent != 0; }

using PrimitiveKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, int, int, float, float>;

class OneDnnMatmuls {
 public:
  OneDnnMatmuls() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  void run(const MatmulDims& d, bool ta, bool tb, const void* a, const void* b, void* c, dnnl::memory::data_type ab,
           dnnl::memory::data_type ct, float alpha, float beta) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entry(d, ta, tb, ab, ct, alpha, beta);
    // The memory objects of this call's extents (the primitive's may leave m or k open) are
    // kept with the primitive: only the pointers change from call to call. Making them for
    // each call cost about 1 us of a [64 x 64] x [64 x 64] product's 2.7 here.
    auto it = e.args.find({d.m, d.k});
    if (it == e.args.end()) {
      if (e.args.size() >= kExtentsPerEntry) e.args.clear();  // a MoE expert's varying rows
      const Descs x = descs(d, d.m, d.k, ta, tb, ab, ct);
      it = e.args
               .emplace(std::pair{d.m, d.k}, Args{{DNNL_ARG_SRC, dnnl::memory(x.a, engine_, DNNL_MEMORY_NONE)},
                                                  {DNNL_ARG_WEIGHTS, dnnl::memory(x.b, engine_, DNNL_MEMORY_NONE)},
                                                  {DNNL_ARG_DST, dnnl::memory(x.c, engine_, DNNL_MEMORY_NONE)}})
               .first;
    }
    Args& args = it->second;
    args[DNNL_ARG_SRC].set_data_handle(const_cast<void*>(a));
    args[DNNL_ARG_WEIGHTS].set_data_handle(const_cast<void*>(b));
    args[DNNL_ARG_DST].set_data_handle(c);
    e.prim.execute(stream_, args);
    stream_.wait();
  }

  std::string impl_name(const MatmulDims& d, bool ta, bool tb, dnnl::memory::data_type ab, dnnl::memory::data_type ct,
                        float beta) {
    std::lock_guard<std::mutex> lock(mu_);
    return entry(d, ta, tb, ab, ct, 1.0f, beta).impl;
  }

  int64_t built() {
    std::lock_guard<std::mutex> lock(mu_);
    return built_;
  }

 private:
  struct Descs {
    dnnl::memory::desc a, b, c;
  };
  using Args = std::unordered_map<int, dnnl::memory>;  // SRC, WEIGHTS, DST
  // Extents (m, k) one primitive keeps memory objects for; more are dropped at once.
  static constexpr size_t kExtentsPerEntry = 64;
  struct Entry {
    dnnl::matmul prim;
    std::string impl;
    std::map<std::pair<int64_t, int64_t>, Args> args;  // by the call's (m, k)
  };
  // A model has a dozen products per shape (a few shape classes by three transposes); a
  // cache that outgrows this is cleared rather than evicted one by one.
  static constexpr size_t kCapacity = 256;

  // Row-major operands as stored; a transpose is the same memory with swapped strides. m and
  // k may be DNNL_RUNTIME_DIM_VAL (the leading dimensions never are).
  static Descs descs(const MatmulDims& d, int64_t m, int64_t k, bool ta, bool tb, dnnl::memory::data_type ab,
                     dnnl::memory::data_type ct) {
    using dims = dnnl::memory::dims;
    return Descs{dnnl::memory::desc(dims{m, k}, ab, ta ? dims{1, d.lda} : dims{d.lda, 1}),
                 dnnl::memory::desc(dims{k, d.n}, ab, tb ? dims{1, d.ldb} : dims{d.ldb, 1}),
                 dnnl::memory::desc(dims{m, d.n}, ct, dims{d.n, 1})};
  }

  Entry& entry(const MatmulDims& d, bool ta, bool tb, dnnl::memory::data_type ab, dnnl::memory::data_type ct,
                     float alpha, float beta) {
    const int64_t m = runtime_extent(d.m) ? DNNL_RUNTIME_DIM_VAL : d.m;
    const int64_t k = runtime_extent(d.k) ? DNNL_RUNTIME_DIM_VAL : d.k;
    const PrimitiveKey key{m, d.n, k, d.lda, d.ldb, ta, tb, static_cast<int>(ab), static_cast<int>(ct), alpha, beta};
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    if (cache_.size() >= kCapacity) cache_.clear();
    const Descs x = descs(d, m, k, ta, tb, ab, ct);
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops po;
      po.append_sum(beta);
      attr.set_post_ops(po);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x.a, x.b, x.c), attr, engine_);
    Entry e;
    e.impl = pd.impl_info_str();
    e.prim = dnnl::matmul(pd);
    ++built_;
    return cache_.emplace(key, std::move(e)).first->second;
  }

  dnnl::engine engine_;
  dnnl::stream stream_;
  std::mutex mu_;
  std::map<PrimitiveKey, Entry> cache_;
  int64_t built_ = 0;
};

OneDnnMatmuls& onednn() {
  static OneDnnMatmuls m;
  return m;
}

void run_onednn(const MatmulDims& d, bool ta, bool tb, const void* a, const void* b, void* c,
                dnnl::memory::data_type ab, dnnl::memory::data_type ct, float alpha, float beta) {
  try {
    onednn().run(d, ta, tb, a, b, c, ab, ct, alpha, beta);
  } catch (const dnnl::error& e) {
    FP_CHECK(false, "oneDNN matmul m={} n={} k={} trans_a={} trans_b={}: {} (status {})", d.m, d.n, d.k, ta, tb,
             e.what(), static_cast<int>(e.status));
  }
}

// ---- the skinny kernel ----

// Few rows of a (decode: one token per sequence). sgemm packs the whole of b for them, which
// costs more than the product once b outgrows the cache; streaming b once instead, as dot
// products with its rows (b transposed: 4 rows of b by 2 rows of a per pass, 8-float
// vectors) or as row updates (b as stored), runs up to 3x faster at 2-4 rows, and loses to
// sgemm only on weights small enough to stay in cache (bench/matmul_bench: docs/
// PERFORMANCE.md, generation). a is not transposed; c [m, n] row-major.
constexpr int64_t kSkinnyRows = 4;
constexpr int kDotLanes = 8;  // partial sums per output: one 256-bit vector
constexpr int kDotCols = 4;   // outputs computed together: each x load feeds 4 weight rows

// GCC/Clang vector extension: 8 floats, element-wise arithmetic; unaligned loads by memcpy.
typedef float Lanes __attribute__((vector_size(kDotLanes * sizeof(float))));
inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float lane_sum(Lanes v) {
  float s = 0;
  for (int l = 0; l < kDotLanes; ++l) s += v[l];
  return s;
}

// c = alpha a b^T + beta c by dot products with b's rows.
void skinny_matmul_bt(const MatmulDims& d, const float* a, const float* b, float* c, float alpha, float beta) {
  const int64_t k_vec = d.k / kDotLanes * kDotLanes;
  for (int64_t j0 = 0; j0 < d.n; j0 += kDotCols) {
    const int64_t cols = std::min<int64_t>(kDotCols, d.n - j0);
    // Past the last column the block repeats row j0 (valid memory; results dropped).
    const float* w0 = b + j0 * d.ldb;
    const float* w1 = cols > 1 ? w0 + d.ldb : w0;
    const float* w2 = cols > 2 ? w0 + 2 * d.ldb : w0;
    const float* w3 = cols > 3 ? w0 + 3 * d.ldb : w0;
    const float* w[kDotCols] = {w0, w1, w2, w3};
    // Two rows of a at a time: 8 running sums, each weight load feeding two of them.
    for (int64_t i = 0; i < d.m; i += 2) {
      const bool pair = i + 1 < d.m;
      const float* x = a + i * d.lda;
      const float* x2 = pair ? x + d.lda : x;  // unused for a lone row
      Lanes s0 = {}, s1 = {}, s2 = {}, s3 = {}, t0 = {}, t1 = {}, t2 = {}, t3 = {};
      for (int64_t k = 0; !pair && k < k_vec; k += kDotLanes) {  // a lone last row
        const Lanes xv = load_lanes(x + k);
        s0 += xv * load_lanes(w0 + k);
        s1 += xv * load_lanes(w1 + k);
        s2 += xv * load_lanes(w2 + k);
        s3 += xv * load_lanes(w3 + k);
      }
      for (int64_t k = 0; pair && k < k_vec; k += kDotLanes) {
        const Lanes xv = load_lanes(x + k), yv = load_lanes(x2 + k);
        const Lanes v0 = load_lanes(w0 + k), v1 = load_lanes(w1 + k), v2 = load_lanes(w2 + k),
                    v3 = load_lanes(w3 + k);
        s0 += xv * v0;
        s1 += xv * v1;
        s2 += xv * v2;
        s3 += xv * v3;
        t0 += yv * v0;
        t1 += yv * v1;
        t2 += yv * v2;
        t3 += yv * v3;
      }
      const float sums[2][kDotCols] = {{lane_sum(s0), lane_sum(s1), lane_sum(s2), lane_sum(s3)},
                                       {lane_sum(t0), lane_sum(t1), lane_sum(t2), lane_sum(t3)}};
      for (int r = 0; r < (pair ? 2 : 1); ++r) {
        const float* xr = r == 0 ? x : x2;
        for (int64_t jj = 0; jj < cols; ++jj) {
          float sum = sums[r][jj];
          for (int64_t k = k_vec; k < d.k; ++k) sum += xr[k] * w[jj][k];
          float& y = c[(i + r) * d.n + j0 + jj];
          y = beta == 0 ? alpha * sum : alpha * sum + beta * y;  // beta 0 ignores the old value (NaN too)
        }
      }
    }
  }
}

// c = alpha a b + beta c by row updates with b's rows.
void skinny_matmul_bn(const MatmulDims& d, const float* a, const float* b, float* c, float alpha, float beta) {
  for (int64_t i = 0; i < d.m; ++i) {
    float* y = c + i * d.n;
    if (beta == 0) {
      std::fill_n(y, d.n, 0.0f);
    } else if (beta != 1) {
      for (int64_t j = 0; j < d.n; ++j) y[j] *= beta;
    }
  }
  for (int64_t k = 0; k < d.k; ++k) {
    const float* w = b + k * d.ldb;
    for (int64_t i = 0; i < d.m; ++i) {
      const float s = alpha * a[i * d.lda + k];
      float* y = c + i * d.n;
      for (int64_t j = 0; j < d.n; ++j) y[j] += s * w[j];
    }
  }
}

}  // namespace

const char* gemm_engine_name(GemmEngine e) {
  switch (e) {
    case GemmEngine::kAuto: return "auto";
    case GemmEngine::kOneDnn: return "onednn";
    case GemmEngine::kOpenBlas: return "openblas";
    case GemmEngine::kSkinny: return "skinny";
  }
  return "?";
}

std::string GemmEngineReport::summary() const {
  const std::string blas = openblas_matches_cpu
                               ? std::string("matches the cpu")
                               : fmt::format("slow for this cpu: unused; {} would fix it", openblas_fix);
  return fmt::format("gemm {} (onednn isa {}), openblas core {} ({}), bf16 {}, cpu {}", f32_engine, onednn_isa,
                     openblas_core, blas, bf16_native ? "native" : "widened to f32", cpu_isa);
}

const GemmEngineReport& gemm_engine_report() { return engine_state().report; }

std::string cpu_gemm_engine_summary() { return gemm_engine_report().summary(); }
std::string cpu_gemm_engine_warning() { return gemm_engine_report().warning; }

// From bench/gemm_engine_bench and `foldpar bench` on this machine (docs/PERFORMANCE.md,
// "GEMM engines"): the skinny kernel beats both libraries at decode's 1-4 rows. Per product,
// oneDNN f32 and OpenBLAS on its right core are within 10% of each other (OpenBLAS ahead by
// 0.68-0.82x on one class), but the training step runs 1.3x faster with every product on
// such an OpenBLAS (the flash attention kernel runs 3-4x slower in a process whose GEMMs ran
// elsewhere; cause not yet found). So: OpenBLAS where its core uses the CPU's widest
// vectors, oneDNN (4-6x faster) where it does not.
GemmEngine choose_f32_engine(const MatmulDims& d, bool trans_a, bool trans_b) {
  if (!trans_a && d.m <= kSkinnyRows) return GemmEngine::kSkinny;
  return engine_state().openblas_ok ? GemmEngine::kOpenBlas : GemmEngine::kOneDnn;
}

void gemm_f32(GemmEngine engine, const MatmulDims& d, bool ta, bool tb, const float* a, const float* b, float* c,
              float alpha, float beta) {
  if (engine == GemmEngine::kAuto) engine = choose_f32_engine(d, ta, tb);
  switch (engine) {
    case GemmEngine::kSkinny:
      FP_CHECK(!ta, "the skinny kernel does not transpose a");
      return tb ? skinny_matmul_bt(d, a, b, c, alpha, beta) : skinny_matmul_bn(d, a, b, c, alpha, beta);
    case GemmEngine::kOpenBlas:
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                  static_cast<int>(d.m), static_cast<int>(d.n), static_cast<int>(d.k), alpha, a,
                  static_cast<int>(d.lda), b, static_cast<int>(d.ldb), beta, c, static_cast<int>(d.n));
      return;
    case GemmEngine::kOneDnn:
    case GemmEngine::kAuto:
      engine_state();  // the thread setting happens before oneDNN's first parallel region
      run_onednn(d, ta, tb, a, b, c, dnnl::memory::data_type::f32, dnnl::memory::data_type::f32, alpha, beta);
      return;
  }
}

void gemm_f32_strided(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (engine_state().openblas_ok) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m),
                static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb),
                beta, c, static_cast<int>(ldc));
    return;
  }
  const dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  FP_CHECK(st == dnnl_success, "dnnl_sgemm [{}, {}, {}] failed with status {}", m, n, k, static_cast<int>(st));
}

void gemm_bf16(const MatmulDims& d, bool ta, bool tb, const bf16* a, const bf16* b, DType c_dtype, void* c,
               float alpha, float beta) {
  FP_CHECK(c_dtype == DType::kF32 || c_dtype == DType::kBF16, "bf16 gemm output dtype {}", dtype_name(c_dtype));
  engine_state();
  run_onednn(d, ta, tb, a, b, c, dnnl::memory::data_type::bf16,
             c_dtype == DType::kF32 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16, alpha, beta);
}

void set_gemm_threads(int threads) {
  openblas_set_num_threads(threads);
  omp_set_num_threads(threads);
}

int64_t onednn_primitives_built() { return onednn().built(); }

std::string onednn_impl_name(const MatmulDims& d, bool ta, bool tb, DType ab_dtype, DType c_dtype, float beta) {
  const auto dt = [](DType t) { return t == DType::kBF16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32; };
  return onednn().impl_name(d, ta, tb, dt(ab_dtype), dt(c_dtype), beta);
}

}  // namespace foldpar
