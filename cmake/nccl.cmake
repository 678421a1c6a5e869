# Included by CMakeLists.txt after find_package(CUDAToolkit); sets FOLDPAR_NCCL_LIBRARY and
# FOLDPAR_NCCL_INCLUDE_DIR or stops with what was searched. Tested by tests/gpu/nccl_find/.
# NCCL: a Debian/toolkit install (libnccl.so, nccl.h) or Python's wheel, which has only
# libnccl.so.2 with nccl.h beside it (.../site-packages/nvidia/nccl/{lib,include}). Hints,
# in this order (NAMES_PER_DIR: the first folder with either name wins): FOLDPAR_NCCL_ROOT (cache or environment), NCCL_ROOT (environment),
# the toolkit, then the site-packages of every python3 on PATH.
set(FOLDPAR_NCCL_ROOT "$ENV{FOLDPAR_NCCL_ROOT}" CACHE PATH "Where NCCL is (lib/ and include/ below it)")
set(foldpar_nccl_hints ${FOLDPAR_NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT}
    ${CUDAToolkit_TARGET_DIR})
find_program(FOLDPAR_PYTHON3 NAMES python3 NO_CMAKE_FIND_ROOT_PATH)
if(FOLDPAR_PYTHON3)
  execute_process(COMMAND ${FOLDPAR_PYTHON3} -c
      "import site,sys; print(';'.join(site.getsitepackages() + [site.getusersitepackages()]))"
    OUTPUT_VARIABLE foldpar_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  foreach(dir IN LISTS foldpar_site)
    list(APPEND foldpar_nccl_hints ${dir}/nvidia/nccl)
  endforeach()
endif()
find_library(FOLDPAR_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
  HINTS ${foldpar_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64 NO_CMAKE_FIND_ROOT_PATH)
find_path(FOLDPAR_NCCL_INCLUDE_DIR nccl.h
  HINTS ${foldpar_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include NO_CMAKE_FIND_ROOT_PATH)
if(NOT FOLDPAR_NCCL_LIBRARY OR NOT FOLDPAR_NCCL_INCLUDE_DIR)
  message(FATAL_ERROR "NCCL not found (library: '${FOLDPAR_NCCL_LIBRARY}', nccl.h: "
    "'${FOLDPAR_NCCL_INCLUDE_DIR}'); searched ${foldpar_nccl_hints}; set FOLDPAR_NCCL_ROOT to the "
    "folder holding lib/libnccl.so* and include/nccl.h (for the Python wheel: .../site-packages/nvidia/nccl)")
endif()
message(STATUS "NCCL: ${FOLDPAR_NCCL_LIBRARY}, ${FOLDPAR_NCCL_INCLUDE_DIR}")
