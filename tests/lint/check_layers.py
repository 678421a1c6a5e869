#!/usr/bin/python3
"""The layering check: every #include "..." and every layer target's links against the layer
map in docs/design.md (the fenced block that starts with ```layers).

Usage: check_layers.py [--root DIR]   (DIR: a foldpar tree; default: this file's repository)
Exit 0 when every edge is allowed; 1 with one line per violation ("file:line: ..."); 2 when
the map itself cannot be read.

What it checks, over src/, tools/, bench/, tests/ and fuzz/ (C++ and CUDA sources):
  1. each #include "x" of a file in layer L names a file of a layer that L may include
     (the map lists each layer's direct dependencies; the relation is transitive);
  2. each foldpar_* target defined under src/ links (target_link_libraries) only foldpar_*
     targets of layers its own layer may include;
  3. each include across two src/ layer targets is backed by a link: the including target
     reaches the included layer's target through its direct links and their PUBLIC links,
     so a layer does not compile only because every target sees the one src/ include root.
Layers under src/ are named by their folder there ("model", "parallel/tsp"), the others by
their folder in the repository ("tools", "tests/unit"); a file belongs to the longest
matching one. A layer's target is foldpar_<layer, '/' as '_'> when CMake defines it, else
its parent layer's (parallel/tsp compiles into foldpar_parallel).
"""
import argparse
import os
import re
import sys

SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh", ".hpp", ".cpp", ".inc")
SCANNED_TOP = ("src", "tools", "bench", "tests", "fuzz")
OUTER_TOP = ("tools", "bench", "tests", "fuzz")  # layers named by their folder in the repository
# The include roots the build passes (-I): src/ for everything, the repository root (fuzz),
# tests/ (the test support targets). A quoted include is first looked up beside its file.
INCLUDE_ROOTS = ("src", ".", "tests")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
MAP_START = "```layers"


class MapError(Exception):
    pass


def parse_layer_map(design_path):
    """{layer: set of direct dependencies} from the ```layers block of docs/design.md."""
    try:
        with open(design_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise MapError(f"cannot read the layer map: {e}")
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == MAP_START)
    except StopIteration:
        raise MapError(f"{design_path}: no {MAP_START} block")
    deps = {}
    for n, line in enumerate(lines[start + 1:], start + 2):
        if line.strip() == "```":
            break
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if ":" not in text:
            raise MapError(f"{design_path}:{n}: expected '<layer>: <layers it may include>', got '{line.strip()}'")
        name, rest = text.split(":", 1)
        name = name.strip()
        if name in deps:
            raise MapError(f"{design_path}:{n}: layer '{name}' listed twice")
        deps[name] = set(rest.split())
    else:
        raise MapError(f"{design_path}: the {MAP_START} block has no closing ```")
    for name, ds in deps.items():
        for d in sorted(ds):
            if d not in deps:
                raise MapError(f"{design_path}: layer '{name}' may include '{d}', which the map does not define")
    return deps


def closure(deps):
    """{layer: every layer it may include, itself included}."""
    allowed = {}
    for layer in deps:
        seen, todo = {layer}, [layer]
        while todo:
            for d in deps[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        allowed[layer] = seen
    return allowed


def layer_paths(deps):
    """{repository-relative folder: layer}."""
    return {(l if l.split("/")[0] in OUTER_TOP else "src/" + l): l for l in deps}


def layer_of(rel_path, paths):
    """The layer of a repository-relative file: its longest matching layer folder, or None."""
    best = None
    for folder, layer in paths.items():
        if rel_path.startswith(folder + "/") and (best is None or len(folder) > len(best[0])):
            best = (folder, layer)
    return best[1] if best else None


def source_files(root):
    for top in SCANNED_TOP:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(SOURCE_SUFFIXES):
                    yield os.path.relpath(os.path.join(dirpath, name), root)


def resolve_include(root, rel_file, inc):
    """The repository-relative file a quoted include names, or None when it is not in the tree."""
    candidates = [os.path.join(os.path.dirname(rel_file), inc)] + [os.path.join(r, inc) for r in INCLUDE_ROOTS]
    for c in candidates:
        c = os.path.normpath(c)
        if not c.startswith("..") and os.path.isfile(os.path.join(root, c)):
            return c
    return None


def include_edges(root, paths):
    """(file, line, include text, from layer, to layer) for every quoted include of a layer file."""
    for rel in source_files(root):
        src_layer = layer_of(rel, paths)
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                m = INCLUDE_RE.match(line)
                if not m:
                    continue
                inc = m.group(1)
                target = resolve_include(root, rel, inc)
                # A header that is not in the tree (generated into the build folder) still has a
                # layer when its path names one: "comm/x.h" is comm's.
                dst_layer = layer_of(target, paths) if target else layer_of("src/" + inc, paths)
                if dst_layer is not None:
                    yield rel, n, inc, src_layer, dst_layer


# ---- CMake: which target each layer compiles into, and what it links ----

CMAKE_COMMAND_RE = re.compile(r"\b(add_library|target_link_libraries)\s*\(([^()]*)\)")
LINK_KEYWORDS = {"PUBLIC", "PRIVATE", "INTERFACE"}


def strip_cmake_comments(text):
    return "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())


def parse_cmake(root):
    """({target: defining CMakeLists folder}, {target: [(keyword, linked target, file, line)]})."""
    defined, links = {}, {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "src")):
        dirnames.sort()
        if "CMakeLists.txt" not in filenames:
            continue
        path = os.path.join(dirpath, "CMakeLists.txt")
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as f:
            text = strip_cmake_comments(f.read())
        for m in CMAKE_COMMAND_RE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            args = m.group(2).split()
            if not args:
                continue
            if m.group(1) == "add_library":
                defined[args[0]] = os.path.relpath(dirpath, root)
                continue
            keyword = "PUBLIC"  # the plain signature propagates like PUBLIC
            for a in args[1:]:
                if a in LINK_KEYWORDS:
                    keyword = a
                elif a.startswith("foldpar_"):
                    links.setdefault(args[0], []).append((keyword, a, rel, line))
    return defined, links


def layer_targets(deps, defined):
    """{layer: its target} for the layers under src/ (foldpar_<layer> or its parent's)."""
    result = {}
    for layer in deps:
        if layer.split("/")[0] in OUTER_TOP:
            continue
        parts = layer.split("/")
        while parts:
            name = "foldpar_" + "_".join(parts)
            if name in defined:
                result[layer] = name
                break
            parts.pop()
    return result


def reachable_targets(target, links):
    """Targets whose usage requirements `target` gets: its direct links and, from them on,
    their PUBLIC and INTERFACE links."""
    seen = {target}
    todo = [d for _, d, _, _ in links.get(target, [])]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        todo.extend(d for kw, d, _, _ in links.get(t, []) if kw in ("PUBLIC", "INTERFACE"))
    return seen


def check(root):
    """The violations, one line each."""
    design = os.path.join(root, "docs", "design.md")
    deps = parse_layer_map(design)
    allowed = closure(deps)
    paths = layer_paths(deps)
    problems = []
    for folder in sorted(paths):
        if not os.path.isdir(os.path.join(root, folder)):
            problems.append(f"docs/design.md: layer '{paths[folder]}' has no folder {folder}/")

    defined, links = parse_cmake(root)
    targets = layer_targets(deps, defined)
    target_layer = {}
    for layer, t in targets.items():
        if t not in target_layer or len(layer) < len(target_layer[t]):
            target_layer[t] = layer
    for t, folder in defined.items():
        if folder == "src":
            continue  # src/CMakeLists.txt's aggregate (foldpar_all) for the programs, no layer
        layer = layer_of(folder + "/x", paths)
        if layer is None:
            problems.append(f"{folder}/CMakeLists.txt: target {t} is in no layer of the map")
        elif t not in target_layer:
            target_layer[t] = layer

    for rel in source_files(root):
        if rel.startswith("src/") and layer_of(rel, paths) is None:
            problems.append(f"{rel}: in no layer of the map (docs/design.md)")
    edges_seen = set()
    for rel, n, inc, src_layer, dst_layer in include_edges(root, paths):
        if src_layer is None:
            continue
        if dst_layer not in allowed[src_layer]:
            may = ", ".join(sorted(allowed[src_layer] - {src_layer})) or "nothing"
            problems.append(f'{rel}:{n}: {src_layer} -> {dst_layer} is not allowed (#include "{inc}"); '
                            f"{src_layer} may include: {may}")
            continue
        src_t, dst_t = targets.get(src_layer), targets.get(dst_layer)
        if src_t and dst_t and src_t != dst_t and (src_t, dst_t) not in edges_seen:
            edges_seen.add((src_t, dst_t))
            if dst_t not in reachable_targets(src_t, links):
                problems.append(f'{rel}:{n}: {src_layer} includes {dst_layer} (#include "{inc}") but {src_t} does not '
                                f"link {dst_t}, directly or through a PUBLIC link")

    for t, ls in sorted(links.items()):
        t_layer = target_layer.get(t)
        if t_layer is None:
            continue
        for _, d, rel, line in ls:
            d_layer = target_layer.get(d)
            if d_layer is not None and d_layer not in allowed[t_layer]:
                problems.append(f"{rel}:{line}: {t} ({t_layer}) links {d} ({d_layer}), which the layer map does not "
                                f"allow")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    args = parser.parse_args()
    try:
        problems = check(args.root)
    except MapError as e:
        print(f"check_layers: {e}", file=sys.stderr)
        return 2
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} edge(s) the layer map in docs/design.md does not allow", file=sys.stderr)
        return 1
    print("check_layers: every include and link follows the layer map")
    return 0


if __name__ == "__main__":
    sys.exit(main())
