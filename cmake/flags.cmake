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
#
# Glue code (the test programs, the foldpar program's command files, the benchmarks' mains:
# directories that set the directory property FOLDPAR_GLUE) computes nothing hot itself; it
# calls the libraries. It compiles at -O1, 40% faster than -O3 (gtest, CLI11, fmt and json
# templates are most of its code), and under the sanitizers at -O0, 2.5x faster than -O1;
# the libraries it calls keep -O3 (-O1 under the sanitizers), so timings and test run times
# are the libraries'. This keeps scripts/test.sh's two builds inside CI's time.
define_property(DIRECTORY PROPERTY FOLDPAR_GLUE INHERITED)
define_property(TARGET PROPERTY FOLDPAR_GLUE INHERITED)
set(foldpar_glue "$<BOOL:$<TARGET_PROPERTY:FOLDPAR_GLUE>>")
target_compile_options(foldpar_flags INTERFACE $<$<CONFIG:Release>:$<IF:${foldpar_glue},-O1,-O3>>)
if(FOLDPAR_SANITIZE)
  # -g1: function names and line tables, all a sanitizer report needs; compiles 2.5x faster
  # than -g, which keeps scripts/test.sh's sanitizer pass inside CI's time.
  target_compile_options(foldpar_flags INTERFACE -fsanitize=${FOLDPAR_SANITIZE} -fno-omit-frame-pointer -g1
                         $<${foldpar_glue}:-O0>)
  target_link_options(foldpar_flags INTERFACE -fsanitize=${FOLDPAR_SANITIZE})
endif()

# Single source files that are glue in a library target (JSON parsers of configs, hardware
# files and headers): the glue levels above, set per file. Call it in the directory that
# adds the target.
function(foldpar_glue_sources)
  if(FOLDPAR_SANITIZE)
    set_property(SOURCE ${ARGN} APPEND PROPERTY COMPILE_OPTIONS -O0)
  else()
    set_property(SOURCE ${ARGN} APPEND PROPERTY COMPILE_OPTIONS $<$<CONFIG:Release>:-O1>)
  endif()
endfunction()
