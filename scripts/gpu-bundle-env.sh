# Sourced by scripts/gpu-check.sh and scripts/gpu-bundle-check.sh (not run on its own):
# unpacks gpu-bundle/prefix.tar.xz (made by scripts/gpu-bundle.sh) into gpu-bundle/prefix
# once, and sets what a build and the tests need to use it:
#   PATH, LD_LIBRARY_PATH  the bundle's programs (mpirun) and libraries first;
#   OPAL_PREFIX            OpenMPI relocated into the bundle (mpirun finds its plugins there);
#   LIBRARY_PATH, CPATH, PKG_CONFIG_PATH  the bundle's libraries, headers, .pc files;
#   bundle_cmake_args      the configure arguments: CMAKE_PREFIX_PATH for the CMake packages
#                          (fmt, nlohmann_json, CLI11, GTest, benchmark, oneDNN), and FindMPI's
#                          variables by path (its mpicc wrapper data names /usr);
#   bundle_prefix          the prefix (…/gpu-bundle/prefix/usr).
# Returns 1 with a message on stderr when the bundle is missing or damaged.
bundle_setup() {
  local repo=$1 arch=x86_64-linux-gnu
  local dir=$repo/gpu-bundle
  if [ ! -f "$dir/prefix.tar.xz" ]; then
    echo "no bundle: $dir/prefix.tar.xz is missing (run scripts/gpu-bundle.sh on a machine with the Debian registry)" >&2
    return 1
  fi
  local sum
  sum=$(sha256sum "$dir/prefix.tar.xz" | cut -d' ' -f1)
  if [ ! -f "$dir/prefix/.unpacked" ] || [ "$(cat "$dir/prefix/.unpacked")" != "$sum" ]; then
    if [ -f "$dir/prefix.sha256" ] && [ "$(cat "$dir/prefix.sha256")" != "$sum" ]; then
      echo "bundle damaged: sha256 of $dir/prefix.tar.xz is not the one in prefix.sha256" >&2
      return 1
    fi
    rm -rf "$dir/prefix" && mkdir -p "$dir/prefix"
    if ! xz -dc "$dir/prefix.tar.xz" | tar -C "$dir/prefix" -xf -; then
      echo "bundle: could not unpack $dir/prefix.tar.xz" >&2
      return 1
    fi
    echo "$sum" >"$dir/prefix/.unpacked"
  fi
  bundle_prefix=$dir/prefix/usr
  local lib=$bundle_prefix/lib/$arch
  export PATH="$bundle_prefix/bin:$PATH"
  export LD_LIBRARY_PATH="$lib:$lib/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PREFIX=$bundle_prefix
  # Headers of libraries linked by bare name (sentencepiece): the compiler searches CPATH
  # after -I/-isystem and before /usr/include. (LIBRARY_PATH: for links outside CMake.)
  export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export CPATH="$bundle_prefix/include${CPATH:+:$CPATH}"
  export PKG_CONFIG_PATH="$lib/pkgconfig:$bundle_prefix/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  bundle_cmake_args=(
    -DCMAKE_PREFIX_PATH="$bundle_prefix"
    -DMPI_C_COMPILER="$(command -v gcc || command -v cc)"
    -DMPI_C_HEADER_DIR="$lib/openmpi/include"
    -DMPI_C_LIB_NAMES=mpi
    -DMPI_mpi_LIBRARY="$lib/openmpi/lib/libmpi.so"
    -DMPIEXEC_EXECUTABLE="$bundle_prefix/bin/mpirun"
    # -lsentencepiece (linked by bare name): -L on the link line precedes the compiler's
    # own folders (LIBRARY_PATH does not: a system copy in /usr/lib would win).
    -DCMAKE_EXE_LINKER_FLAGS="-L$lib"
    -DCMAKE_SHARED_LINKER_FLAGS="-L$lib"
  )
}
