// The harness of GoogleTest programs that run under mpirun (tests/parallel/mpi_test_main.cc):
// main() creates the process's MpiRuntime (options from FOLDPAR_COMM_* in the environment)
// and tests reach it here. A test's collectives must stay in step on every rank, so tests
// compare data with EXPECT_* (which continues) and keep ASSERT_* for conditions that hold
// on all ranks alike.
#pragma once

#include "comm/mpi_runtime.h"

namespace foldpar::test {

MpiRuntime& mpi();

}  // namespace foldpar::test
