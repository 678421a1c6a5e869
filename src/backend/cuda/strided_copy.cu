// Block copies of the CUDA backend (Backend::copy_strided): one grid-stride pass over the
// block's elements, moved as 1-, 2-, 4- or 8-byte words, so any dtype copies unchanged.
#include "backend/cuda/cuda_common.cuh"

namespace foldpar::cuda {
namespace {

template <typename Word>
__global__ void strided_copy_kernel(const Word* src, Word* dst, StridedCopyShape s) {
  FP_GRID_STRIDE(k, s.rows * s.cols) {
    const int64_t i = k / s.cols, j = k % s.cols;
    dst[s.dst_offset + i * s.dst_row_stride + j] = src[s.src_offset + i * s.src_row_stride + j];
  }
}

template <typename Word>
void launch_words(const void* src, void* dst, const StridedCopyShape& s, cudaStream_t stream) {
  strided_copy_kernel<Word><<<grid_for(s.rows * s.cols), kThreads, 0, stream>>>(static_cast<const Word*>(src),
                                                                               static_cast<Word*>(dst), s);
  FP_CUDA_LAUNCHED();
}

}  // namespace

void launch_strided_copy(const void* src, void* dst, size_t element_bytes, const StridedCopyShape& s,
                         cudaStream_t stream) {
  if (s.rows * s.cols == 0) return;
  switch (element_bytes) {
    case 1:
      return launch_words<uint8_t>(src, dst, s, stream);
    case 2:
      return launch_words<uint16_t>(src, dst, s, stream);
    case 4:
      return launch_words<uint32_t>(src, dst, s, stream);
    case 8:
      return launch_words<uint64_t>(src, dst, s, stream);
    default:
      kernel_contract_violated(__FILE__, __LINE__, "strided copy of an element size other than 1, 2, 4 or 8 bytes");
  }
}

}  // namespace foldpar::cuda
