#!/usr/bin/env bash
# expect_exit.sh CODE COMMAND...: passes iff COMMAND exits with CODE.
want=$1; shift
"$@" >/dev/null 2>&1
got=$?
if [ "$got" -ne "$want" ]; then
  echo "expected exit $want, got $got: $*" >&2
  exit 1
fi
