#!/usr/bin/env python3
"""Checks several `foldpar verify --dump` directories against scripts/torch_reference.py in
one process, so that torch is imported once (about 1-5 s a time on a loaded 2-core machine)
instead of once per dump. Each directory goes through torch_reference.main, exactly as
`python3 scripts/torch_reference.py DIR` would.

Usage: torch_oracle_many.py SRC [!]DUMP_DIR...
  SRC        the source tree (torch_reference.py is SRC/scripts/torch_reference.py)
  DUMP_DIR   must pass; !DUMP_DIR must fail (the oracle tells a wrong dump apart)
Prints each failing check's table; exits 1 if any directory gave the wrong verdict, else 0.
"""
import io
import sys


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, f"{argv[1]}/scripts")
    import torch_reference  # noqa: E402 (needs the path above)

    wrong = []
    for arg in argv[2:]:
        must_fail = arg.startswith("!")
        d = arg[1:] if must_fail else arg
        out = io.StringIO()
        rc = torch_reference.main([d], out=out)
        if (rc != 0) != must_fail:
            wrong.append(d)
            verdict = "passed, wanted a failure" if must_fail else f"failed (exit {rc})"
            print(f"FAIL: {d}: {verdict}\n{out.getvalue()}")
        else:
            print(f"{d}: {'fails as it must' if must_fail else 'matches PyTorch'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
