#!/usr/bin/env bash
# The CLI surface, frozen: `foldpar --help` and every subcommand's `--help` must equal the
# stored text in tests/data/cli/ (foldpar.txt, <subcommand>.txt), and the stored files must
# name exactly the subcommands the program lists. A change to a flag, a default or a help
# line fails here until the snapshots are updated on purpose:
#   FOLDPAR_UPDATE_CLI_SNAPSHOTS=1 bash tests/e2e/cli_help.sh build/tools/foldpar .
# (or: FOLDPAR_UPDATE_CLI_SNAPSHOTS=1 ctest --test-dir build -R cli_help), then review the diff.
set -u
bin=$1 src=$2
dir="$src/tests/data/cli"
update=${FOLDPAR_UPDATE_CLI_SNAPSHOTS:-0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

# compare NAME ARGS...: the help text of ARGS against dir/NAME.txt (or write it).
compare() {
  local name=$1; shift
  if ! "$bin" "$@" --help >"$tmp/$name.txt" 2>&1; then
    echo "FAIL: foldpar $* --help exited non-zero" >&2
    failures=$((failures + 1))
    return
  fi
  if [ "$update" = 1 ]; then
    mkdir -p "$dir"
    cp "$tmp/$name.txt" "$dir/$name.txt"
    echo "updated $dir/$name.txt"
  elif [ ! -f "$dir/$name.txt" ]; then
    echo "FAIL: no stored help for '$name' ($dir/$name.txt); regenerate with FOLDPAR_UPDATE_CLI_SNAPSHOTS=1" >&2
    failures=$((failures + 1))
  elif ! diff -u "$dir/$name.txt" "$tmp/$name.txt" >&2; then
    echo "FAIL: foldpar $* --help differs from $dir/$name.txt (above; regenerate on purpose with FOLDPAR_UPDATE_CLI_SNAPSHOTS=1)" >&2
    failures=$((failures + 1))
  fi
}

compare foldpar
# The subcommands as the program lists them, under "Subcommands:".
mapfile -t commands < <(sed -n '/^Subcommands:/,/^$/p' "$tmp/foldpar.txt" | sed -n 's/^  \([a-z][a-z-]*\) .*/\1/p')
[ "${#commands[@]}" -ge 10 ] || { echo "FAIL: only ${#commands[@]} subcommands read from foldpar --help" >&2; exit 1; }
for c in "${commands[@]}"; do compare "$c" "$c"; done

# No stored file for a subcommand that no longer exists.
if [ "$update" = 1 ]; then
  for f in "$dir"/*.txt; do
    n=$(basename "$f" .txt)
    [ "$n" = foldpar ] || printf '%s\n' "${commands[@]}" | grep -qx "$n" || { rm "$f"; echo "removed $f"; }
  done
else
  for f in "$dir"/*.txt; do
    n=$(basename "$f" .txt)
    [ "$n" = foldpar ] || printf '%s\n' "${commands[@]}" | grep -qx "$n" ||
      { echo "FAIL: $f is stored but foldpar has no subcommand '$n'" >&2; failures=$((failures + 1)); }
  done
fi
[ "$failures" = 0 ] && echo "the help of foldpar and its ${#commands[@]} subcommands matches tests/data/cli/"
exit $((failures > 0))
