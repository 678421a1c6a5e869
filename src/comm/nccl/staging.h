// Staging of communication buffers: which bytes an operation reads and writes, and a
// rewrite of a CommOp onto a staging buffer when its buffers live where the transport
// cannot reach them (device-only memory for MPI, host-only memory for NCCL). Internal to
// comm/nccl.
#pragma once

#include <cstddef>
#include <functional>

#include "comm/comm_op.h"

namespace foldpar::nccl_detail {

// Bytes of send_buf and recv_buf that `op` touches on rank `rank` of `size`.
size_t send_bytes(const CommOp& op, int rank, int size);
size_t recv_bytes(const CommOp& op, int rank, int size);

// One contiguous staged range: `user` is the caller's memory, `staged` its copy.
struct StagedRange {
  char* user = nullptr;
  char* staged = nullptr;
  size_t bytes = 0;
};

// How to copy between the caller's memory and staging memory, and how to get staging
// memory; the NCCL backend stages on the device, the host-staged backend on the host.
struct Stager {
  std::function<bool(const void* p)> needs_staging;
  std::function<char*(size_t bytes)> allocate;  // lives until release_all
  std::function<void(void* dst, const void* src, size_t bytes)> copy;
};

// Whether stage() would stage any of op's buffers (a byte range it touches where
// `unreachable` says the transport cannot reach).
bool needs_staging(const CommOp& op, int rank, int size, const std::function<bool(const void* p)>& unreachable);

// Rewrites op's buffers that need staging onto staging memory (overlapping send/recv
// ranges are staged as one range, so in-place forms stay in place) and copies their
// contents in. Returns the range to copy back after the operation (bytes == 0: none).
StagedRange stage(CommOp& op, int rank, int size, const Stager& stager);

}  // namespace foldpar::nccl_detail
