# Sourced by scripts/build.sh and scripts/test.sh: compile through ccache where it is
# installed (scripts/setup.sh installs it), with paths taken relative to the checkout, so that
# any clone's build of the same sources reuses the objects another clone's build made. Sets
# ccache_flags (CMake's compiler launchers), empty without ccache.
ccache_flags=()
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd)}
  # The sanitizer build has -g1, for which ccache would hash the build directory's path
  # (it goes into the debug info) and miss across clones; line numbers need only the
  # relative paths.
  export CCACHE_NOHASHDIR=1
  ccache_flags=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
