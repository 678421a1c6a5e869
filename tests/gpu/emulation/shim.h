// Host emulation of the CUDA features flash_attention_tc.cu uses: every CUDA thread of a
// block is a std::thread; warp collectives (shfl, ballot, ldmatrix, mma) exchange through a
// per-warp slot array between two barrier phases; __syncthreads is a block barrier.
// FP_SHIM_CORE_ONLY leaves out the stand-ins for foldpar's own types at the end (and
// FP_CUDA_LAUNCHED): host_cuda/cuda_runtime.h, under which a .cu file compiles with the real
// backend headers, defines it.
#pragma once
#include <barrier>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <climits>
#include <functional>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
#ifndef FP_SHIM_CORE_ONLY
#define FP_CUDA_LAUNCHED() ((void)0)
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct int2 { int x, y; };
inline int2 make_int2(int x, int y) { return {x, y}; }
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct float2 { float x, y; };
using cudaStream_t = void*;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int __ffs(int x) { return __builtin_ffs(x); }

struct __nv_bfloat16 { uint16_t bits; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline uint16_t f2bf(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
inline float bf2f(uint16_t b) { uint32_t u = uint32_t{b} << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) { return {{f2bf(lo)}, {f2bf(hi)}}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {bf2f(v.x.bits), bf2f(v.y.bits)}; }

thread_local dim3 threadIdx, blockIdx;
dim3 gridDim, blockDim;

// ---- per-block emulation state ----
constexpr size_t kSmemBytes = 232448;  // sm_90 opt-in maximum (227 KB)
alignas(16) unsigned char g_smem[kSmemBytes];
size_t g_smem_size = 0;
bool g_immediate_copies = true;  // cp.async lands at issue (true) or at the issuer's wait (false)
struct Warp {
  std::barrier<> bar{32};
  uint64_t slot[32][12];
};
struct Block {
  std::barrier<>* bar;
  std::vector<Warp>* warps;
};
Block g_block;
struct PendingCopy { void* dst; const void* src; };
thread_local std::vector<PendingCopy> t_pending;

inline void __syncthreads() { g_block.bar->arrive_and_wait(); }
inline Warp& my_warp() { return (*g_block.warps)[threadIdx.x / 32]; }
inline int my_lane() { return threadIdx.x % 32; }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int o) {
  Warp& w = my_warp();
  const int lane = my_lane();
  memcpy(&w.slot[lane][0], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r;
  memcpy(&r, &w.slot[lane ^ o][0], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}
inline unsigned __ballot_sync(unsigned, bool p) {
  Warp& w = my_warp();
  const int lane = my_lane();
  w.slot[lane][0] = p;
  w.bar.arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= w.slot[i][0] ? 1u << i : 0u;
  w.bar.arrive_and_wait();
  return m;
}

inline void check_smem(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < g_smem || c + bytes > g_smem + g_smem_size) { fprintf(stderr, "smem access out of range\n"); abort(); }
}

namespace tc_emu {
inline void ldmatrix(uint32_t (&r)[4], const __nv_bfloat16* p, bool trans) {
  Warp& w = my_warp();
  const int lane = my_lane();
  check_smem(p, 16);
  if ((reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(g_smem)) % 16 != 0) { fprintf(stderr, "ldmatrix misaligned\n"); abort(); }
  memcpy(&w.slot[lane][0], &p, sizeof(p));
  w.bar.arrive_and_wait();
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    auto at = [&](int row, int col) {
      const __nv_bfloat16* rp;
      memcpy(&rp, &w.slot[8 * i + row][0], sizeof(rp));
      return rp[col].bits;
    };
    uint16_t lo, hi;
    if (!trans) { lo = at(g, 2 * t); hi = at(g, 2 * t + 1); }
    else { lo = at(2 * t, g); hi = at(2 * t + 1, g); }
    r[i] = uint32_t{lo} | (uint32_t{hi} << 16);
  }
  w.bar.arrive_and_wait();
}
}  // namespace tc_emu
inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) { tc_emu::ldmatrix(r, p, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) { tc_emu::ldmatrix(r, p, true); }

inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Warp& w = my_warp();
  const int lane = my_lane();
  for (int i = 0; i < 4; ++i) w.slot[lane][i] = a[i];
  w.slot[lane][4] = b0;
  w.slot[lane][5] = b1;
  w.bar.arrive_and_wait();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    auto lo = [&](int i) { return bf2f(static_cast<uint16_t>(w.slot[l][i] & 0xffff)); };
    auto hi = [&](int i) { return bf2f(static_cast<uint16_t>(w.slot[l][i] >> 16)); };
    A[g][2 * t] = lo(0); A[g][2 * t + 1] = hi(0);
    A[g + 8][2 * t] = lo(1); A[g + 8][2 * t + 1] = hi(1);
    A[g][2 * t + 8] = lo(2); A[g][2 * t + 9] = hi(2);
    A[g + 8][2 * t + 8] = lo(3); A[g + 8][2 * t + 9] = hi(3);
    B[2 * t][g] = lo(4); B[2 * t + 1][g] = hi(4);
    B[2 * t + 8][g] = lo(5); B[2 * t + 9][g] = hi(5);
  }
  const int g = lane / 4, t = lane % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
    c[i] = acc;
  }
  w.bar.arrive_and_wait();
}
inline void cp_async_16(void* dst, const void* src) {
  check_smem(dst, 16);
  if (g_immediate_copies) memcpy(dst, src, 16);
  else t_pending.push_back({dst, src});
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {
  for (auto& c : t_pending) memcpy(c.dst, c.src, 16);
  t_pending.clear();
}

template <typename K>
int cudaFuncSetAttribute(K, cudaFuncAttribute, int bytes) {
  if (bytes > static_cast<int>(kSmemBytes)) { fprintf(stderr, "smem %d > 227 KB\n", bytes); abort(); }
  return 0;
}

template <typename K, typename... Args>
void emulate_launch(K kernel, dim3 grid, int threads, size_t smem, cudaStream_t, Args... args) {
  gridDim = grid;
  blockDim = dim3(threads);
  g_smem_size = smem;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        memset(g_smem, 0xff, kSmemBytes);  // bf16 NaN: reading smem nobody wrote shows up
        std::barrier<> bar(threads);
        std::vector<Warp> warps(static_cast<size_t>((threads + 31) / 32));
        g_block = {&bar, &warps};
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
          ts.emplace_back([&, t] {
            threadIdx = dim3(static_cast<unsigned>(t));
            blockIdx = dim3(x, y, z);
            kernel(args...);
            if (!t_pending.empty()) { fprintf(stderr, "cp.async pending at exit\n"); abort(); }
          });
        for (auto& th : ts) th.join();
      }
}

#ifndef FP_SHIM_CORE_ONLY
namespace foldpar {
enum class DType : uint8_t { kF32, kF64, kBF16, kI32, kI64 };
namespace cuda {
struct FloatPtr { const void* p; DType dtype; };
struct FloatOut { void* p; DType dtype; };
struct AttentionShape { int64_t batch, sq, sk, n_h, n_kv, d; float scale; int64_t window = 0; };
// cuda_common.cuh's visibility helpers (the transform drops that include).
inline bool sees(int q_pos, int k_pos, int64_t window) {
  return k_pos <= q_pos && (window == 0 || int64_t{q_pos} - k_pos < window);
}
inline bool behind_window(int q_lo, int k_hi, int64_t window) { return window > 0 && int64_t{q_lo} - k_hi >= window; }
[[noreturn]] inline void kernel_contract_violated(const char*, int, const char* what) { fprintf(stderr, "%s\n", what); abort(); }
bool attention_tc_supported(const AttentionShape& s, DType dtype);
constexpr int kThreads = 256;
inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
}  // namespace cuda
}  // namespace foldpar
#endif  // FP_SHIM_CORE_ONLY
