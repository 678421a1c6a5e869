# Compiler flags shared by every foldpar target, applied through the foldpar_flags interface.
add_library(foldpar_flags INTERFACE)
target_compile_options(foldpar_flags INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-unused-parameter)
if(FOLDPAR_NATIVE)
  target_compile_options(foldpar_flags INTERFACE -march=native)
endif()
# Kernels are written so that -O3 vectorizes their inner loops; fast-math is NOT used:
# the reference chain needs IEEE semantics (NaN propagation, exact max).
target_compile_options(foldpar_flags INTERFACE $<$<CONFIG:Release>:-O3>)
if(FOLDPAR_SANITIZE)
  target_compile_options(foldpar_flags INTERFACE -fsanitize=${FOLDPAR_SANITIZE} -fno-omit-frame-pointer -g)
  target_link_options(foldpar_flags INTERFACE -fsanitize=${FOLDPAR_SANITIZE})
endif()
