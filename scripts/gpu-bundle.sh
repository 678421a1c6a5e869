#!/usr/bin/env bash
# Gathers what the GPU machine lacks into ONE git-ignored folder, gpu-bundle/, so that
# scripts/gpu-check.sh can build foldpar there with nothing installed or fetched.
# Run it here (a Debian machine that reaches its package registry); the folder travels with
# the working tree. The GPU machine has the CUDA 13 toolkit, cuBLAS, NCCL (Python wheel),
# CMake, ninja, g++ and Python; it lacks every Debian library foldpar builds with.
#
# What it does:
#  1. the library packages are those scripts/setup.sh lists (the one list of dependencies:
#     every '*-dev' package and openmpi-bin, minus the fuzzers' libclang-rt), plus the
#     runtime libraries they need that a bare Linux with a C++ compiler does not have
#     (RUNTIME below: OpenBLAS's pthread build and libgfortran, OpenMPI's libraries, PMIx,
#     hwloc, libevent, fmt, benchmark, sentencepiece, oneDNN when setup.sh lists it);
#  2. `apt-get download`s them (cached in build-bundle/debs) and unpacks each with
#     `dpkg-deb -x` into build-bundle/root;
#  3. prunes what a build and the tests do not use (docs, man pages, locales, static
#     libraries but GoogleTest's and benchmark_main, OpenMPI's Fortran/Java/OpenSHMEM parts
#     and its network plugins for InfiniBand/UCX/libfabric/PSM, LAPACK), flattens
#     OpenBLAS (Debian chooses it with update-alternatives, which dpkg-deb -x does not run),
#     turns absolute symlinks into relative ones, and checks that every shared library
#     left finds its NEEDED libraries in the bundle or in the base system (SYSTEM_LIBS);
#  4. packs the prefix into gpu-bundle/prefix.tar.xz (xz: the .so files are most of the
#     size) with gpu-bundle/MANIFEST.txt (packages, versions, sizes, system libraries
#     assumed). gpu-check.sh unpacks it into gpu-bundle/prefix on first use.
# The CMake package files in it (fmt, nlohmann_json, CLI11, GTest, benchmark) compute their
# prefix from their own location, so the prefix is relocatable as is; MPI is given to
# FindMPI by path (scripts/gpu-check.sh: MPI_C_HEADER_DIR, MPI_C_LIB_NAMES, ...) and
# mpirun runs from the bundle with OPAL_PREFIX.
# Exit status: 0 done, 2 the registry or a tool is missing (the message says which).
# Usage: scripts/gpu-bundle.sh [--force]   (--force: download and unpack again)
set -euo pipefail
cd "$(dirname "$0")/.."
stage=build-bundle
out=gpu-bundle
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
[ "${1:-}" = "--force" ] && rm -rf "$stage" "$out"

for tool in apt-get dpkg-deb readelf objdump xz tar; do
  command -v "$tool" >/dev/null 2>&1 || { echo "gpu-bundle: $tool not found (a Debian machine is needed)" >&2; exit 2; }
done

# 1. The packages: setup.sh's library packages, then their runtime libraries.
mapfile -t dev < <(sed -n '/^packages=(/,/^)/p' scripts/setup.sh | sed 's/#.*//' | tr ' ' '\n' |
                   grep -E -- '-dev$|^openmpi-bin$' | grep -v '^libclang-rt' || true)
[ ${#dev[@]} -gt 0 ] || { echo "gpu-bundle: no library packages found in scripts/setup.sh" >&2; exit 2; }
# The runtime libraries: those OpenBLAS and OpenMPI pull in through alternatives, then every
# library package a -dev package depends on directly (libdnnl2, libicu72, libpcre2-8-0, ...),
# so that a dependency added to setup.sh comes with its runtime without an edit here.
runtime=(googletest libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0
         libopenmpi3 openmpi-common libpmix2 libmunge2 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7)
for p in "${dev[@]}"; do
  while read -r dep; do runtime+=("$dep"); done < <(apt-cache depends "$p" 2>/dev/null |
    sed -n 's/^  Depends: \(lib[^<> ]*\)$/\1/p' | grep -vE -- '-dev$|^libc6$|^libgcc-s1$|^libstdc\+\+6$' || true)
done
# oneDNN's own runtime: the OpenCL loader it links (a virtual package in its Depends, which
# the loop above cannot name); its CMake package also finds OpenCL's C headers (CL/cl.h,
# ocl-icd-opencl-dev's dependency, not a lib* package). Its OpenMP (libgomp) is the
# compiler's own, part of any g++ installation (SYSTEM_LIBS below), not bundled.
case " ${dev[*]} " in *" libdnnl-dev "*) runtime+=(ocl-icd-libopencl1 opencl-c-headers) ;; esac
mapfile -t packages < <(printf '%s\n' "${dev[@]}" "${runtime[@]}" | awk '!seen[$0]++')

# 2. Download (cached) and unpack.
mkdir -p "$stage/debs"
for p in "${packages[@]}"; do
  if ! ls "$stage/debs/${p}_"*.deb >/dev/null 2>&1; then
    if ! (cd "$stage/debs" && apt-get download -q "$p" >/dev/null 2>"../download-$p.err"); then
      # A package the registry does not know is this script's mistake (exit 1, a failure);
      # a registry that cannot be reached is the machine's (exit 2: the check skips).
      if grep -q "Unable to locate package\|Couldn't find any package" "$stage/download-$p.err"; then
        echo "gpu-bundle: no package $p in the registry (fix the list in scripts/gpu-bundle.sh):" >&2
        tail -3 "$stage/download-$p.err" >&2
        exit 1
      fi
      echo "gpu-bundle: apt-get download $p failed (is the package registry reachable?):" >&2
      tail -3 "$stage/download-$p.err" >&2
      exit 2
    fi
  fi
done
root=$stage/root
rm -rf "$root"
mkdir -p "$root"
for deb in "$stage"/debs/*.deb; do dpkg-deb -x "$deb" "$root"; done

# 3. Prune and fix (usr/src: GoogleTest's sources, which Debian ships beside the archives).
lib=$root/usr/lib/$arch
rm -rf "$root"/usr/share/{doc,man,info,lintian,locale,bug,java} "$root"/usr/src "$root/usr/lib/$arch/fortran" "$root"/etc/{alternatives,ld.so.conf.d} \
       "$root"/usr/share/openmpi/{amca-param-sets,mpif*-wrapper-data.txt,mpijava*} "$root"/usr/share/javascript
# OpenBLAS: one library, found by the name FindBLAS asks for, no LAPACK, no static archive.
ob=$lib/openblas-pthread
obso=$(cd "$ob" && ls libopenblasp-r*.so)
mv "$ob/$obso" "$lib/$obso"
ln -sf "$obso" "$lib/libopenblas.so.0"
ln -sf "libopenblas.so.0" "$lib/libopenblas.so"
rm -rf "$ob"/lib*.a "$ob"/libblas* "$ob"/liblapack* "$ob"/cmake "$ob"/libopenblas.so* "$ob/pkgconfig"
rmdir "$ob" 2>/dev/null || true
# Static libraries: only GoogleTest's (Debian ships no shared ones) and benchmark_main.
find "$root" -name '*.a' ! -name 'libgtest*.a' ! -name 'libgmock*.a' ! -name 'libbenchmark_main.a' -delete
# OpenMPI: C only; no Fortran, Java, OpenSHMEM, tracing; no InfiniBand/UCX/libfabric/PSM
# plugins (one node: the shared-memory and TCP transports).
om=$lib/openmpi/lib
rm -f "$om"/libmpi_mpifh* "$om"/libmpi_usempi* "$om"/libmpi_java* "$om"/liboshmem* "$om"/libompitrace* \
      "$om"/libmca_common_{ofi,ucx,verbs}* "$om"/ompi_monitoring_prof* "$lib"/libmpi_mpifh* "$lib"/libmpi_usempi* \
      "$lib"/libmpi_java* "$lib"/liboshmem* "$lib"/libompitrace* "$lib"/libmca_common_{ofi,ucx,verbs}*
rm -rf "$om"/*.mod "$lib"/openmpi/lib/openmpi3/*{ofi,ucx,psm,openib,verbs,usnic,portals,spml,sshmem,scoll,atomic_,memheap,oshmem}* \
       "$root/usr/bin/"{oshmem*,shmem*,ortecc,mpif*,mpijava*,oshcc,oshfort,mpifort*}
# Absolute symlinks (into /usr or /etc) become relative ones inside the prefix.
while IFS= read -r -d '' l; do
  t=$(readlink "$l")
  case $t in /*)
    if [ -e "$root$t" ] || [ -L "$root$t" ]; then ln -sfn "$(realpath -m --relative-to="$(dirname "$l")" "$root$t")" "$l"
    else rm -f "$l"; fi ;;
  esac
done < <(find "$root" -type l -print0)
# pkg-config files: the prefix relative to the file's own folder.
for pc in "$lib"/pkgconfig/*.pc; do sed -i 's|^prefix=/usr$|prefix=${pcfiledir}/../../..|' "$pc"; done
for pc in "$root"/usr/share/pkgconfig/*.pc; do sed -i 's|^prefix=/usr$|prefix=${pcfiledir}/../..|' "$pc"; done
# Programs named as on an installed Debian system (update-alternatives does it there).
ln -sfn orterun "$root/usr/bin/mpirun"
ln -sfn orterun "$root/usr/bin/mpiexec"
find "$root" -xtype l -delete
find "$root" -depth -type d -empty -delete

# Every shared object and program left must find its NEEDED libraries in the bundle or in
# the base system of a machine with g++ (SYSTEM_LIBS). An unexpected one fails the script.
SYSTEM_LIBS='^(libc|libm|libdl|librt|libpthread|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s|libz|libudev|libatomic|libgomp)\.so'
declare -A have=()
while read -r n; do have[$n]=1; done < <(find "$root" \( -type f -o -type l \) -name '*.so*' -printf '%f\n')
unresolved=()
while IFS= read -r -d '' f; do
  file -b "$f" 2>/dev/null | grep -q ELF || continue
  while read -r need; do
    [[ $need =~ $SYSTEM_LIBS ]] && continue
    [ -n "${have[$need]:-}" ] || unresolved+=("$need (needed by ${f#"$root"/})")
  done < <(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
done < <(find "$root" -type f \( -name '*.so*' -o -path '*/bin/*' \) -print0)
# Plugins whose libraries are missing are dropped (OpenMPI and PMIx skip absent plugins).
dropped=()
for u in "${unresolved[@]}"; do
  f=$root/${u#*(needed by }; f=${f%)}
  case $f in */openmpi3/*|*/pmix/*|*/hwloc/*) rm -f "$f"; dropped+=("$u") ;;
             *) echo "gpu-bundle: unresolved library $u" >&2; exit 1 ;;
  esac
done

# 4. Pack, with a manifest.
mkdir -p "$out"
{
  echo "# gpu-bundle: made by scripts/gpu-bundle.sh on $(date -u +%Y-%m-%dT%H:%MZ) ($(. /etc/os-release; echo "$PRETTY_NAME"), $arch)"
  echo "# unpacked size $(du -sh "$root" | cut -f1); packed size: see prefix.tar.xz"
  syms=$(find "$root" -type f \( -name '*.so*' -o -path '*/bin/*' \) -exec objdump -T {} + 2>/dev/null |
         grep -oE 'GLIBC(XX)?_[0-9.]+' | sort -u || true)  # (objdump fails on the non-ELF files)
  echo "# system libraries assumed on the GPU machine: $SYSTEM_LIBS"
  echo "# needs glibc >= $(echo "$syms" | sed -n 's/^GLIBC_//p' | sort -V | tail -1)" \
       "libstdc++ >= GLIBCXX_$(echo "$syms" | sed -n 's/^GLIBCXX_//p' | sort -V | tail -1)" \
       "(the newest symbol versions its files use)"
  echo "# packages:"
  for deb in "$stage"/debs/*.deb; do dpkg-deb -f "$deb" Package Version | paste -sd' '; done | sed 's/^/  /'
  [ ${#dropped[@]} -eq 0 ] || { echo "# plugins dropped (their libraries are not bundled):"; printf '  %s\n' "${dropped[@]}"; }
  echo "# largest files:"
  find "$root" -type f -printf '%s %P\n' | sort -rn | awk 'NR <= 12' | awk '{printf "  %6.1f MiB  %s\n", $1/1048576, $2}'
} >"$out/MANIFEST.txt"
tar -C "$root" -cf - . | xz -T2 -6 >"$out/prefix.tar.xz.tmp"
mv "$out/prefix.tar.xz.tmp" "$out/prefix.tar.xz"
sha256sum "$out/prefix.tar.xz" | cut -d' ' -f1 >"$out/prefix.sha256"
echo "gpu-bundle: $out/prefix.tar.xz $(du -h "$out/prefix.tar.xz" | cut -f1) (unpacked $(du -sh "$root" | cut -f1));" \
     "bundle + repository: $(du -shc --exclude=build* --exclude=gpu-bundle/prefix --exclude=node_modules . | tail -1 | cut -f1)"
