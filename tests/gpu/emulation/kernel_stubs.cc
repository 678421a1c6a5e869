// The launchers' contract checks of the emulated kernel files, as cuda_backend.cc defines
// them on a GPU build (a failure aborts), for the programs of foldpar_launch_emulation.
#include <cstdio>
#include <cstdlib>

namespace foldpar::cuda {
void check_launch(const char*, int) {}
void kernel_contract_violated(const char* file, int line, const char* what) {
  std::fprintf(stderr, "%s:%d: %s\n", file, line, what);
  std::abort();
}
}  // namespace foldpar::cuda
