"""
Draws the project's import graph from the code and checks its shape: no circle, few floors, no library
standing on a command line.

  python tools/imports.py            the floors, top down, with what each module imports; exit 1 on a breach
  python tools/imports.py --check    only the verdict (the suite runs this)

Every import counts, lazy ones inside functions too, since a lazy import is still a dependency a change can
break. A module is a root file (model.py -> "model"), a package (attention/ -> "attention", its files
together), or a script under data/ or tools/ (named by its path). Floor 1 imports nothing of the project;
a module's floor is one above the highest floor it imports. The rules (docs/guide.md, "The house"):
  - no circle;
  - at most MAX_FLOORS floors;
  - no module other than a command line imports a command line, and only ablate.py imports train.py.
"""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FLOORS = 7
# The command lines: a user runs them; nothing below them may import them. data/ and tools/ scripts are
# command lines too (by their place).
COMMANDS = {"train", "rl", "sample", "chat", "eval", "bench", "ablate", "export", "serve", "interpret", "plot"}
TRAINER_USERS = {"ablate"}  # the only module that may import train.py (an ablation runs training runs)
SKIP = {"tests", "config", ".venv", ".git", "__pycache__", "out", ".ci"}


def modules(root=ROOT):
    """Map each module's name to its source files: root files, packages, and scripts under data/ and tools/."""
    found = {}
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if entry.endswith(".py"):
            found[entry[:-3]] = [path]
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            found[entry] = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py"))
        elif os.path.isdir(path) and entry not in SKIP and not entry.startswith("."):
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
                for f in sorted(filenames):
                    if f.endswith(".py"):
                        found[os.path.relpath(os.path.join(dirpath, f), root)] = [os.path.join(dirpath, f)]
    return found


def imported_names(path):
    """The top-level names of every import in one file, lazy imports included (relative ones as '.')."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def graph(root=ROOT):
    """Module -> the set of project modules it imports (scripts under data/ import siblings like shards)."""
    mods = modules(root)
    by_stem = {name: name for name in mods if "/" not in name}
    edges = {}
    for name, files in mods.items():
        local = dict(by_stem)
        if "/" in name:  # a script under data/ reaches its folder's siblings and data/ itself by sys.path
            here = os.path.dirname(name)
            while here:
                for other in mods:
                    if os.path.dirname(other) == here and other.endswith(".py"):
                        local.setdefault(os.path.basename(other)[:-3], other)
                here = os.path.dirname(here)
        edges[name] = {local[n] for f in files for n in imported_names(f) if n in local} - {name}
    return edges


def circles(edges):
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def floors(edges):
    """Module -> its floor (1 = imports nothing of the project); a circle's modules share one floor."""
    group = {v: v for v in edges}
    for component in circles(edges):
        for v in component:
            group[v] = component[0]
    memo = {}

    def floor(g, seen=()):
        if g not in memo:
            below = {group[w] for v in edges if group[v] == g for w in edges[v]} - {g}
            memo[g] = 1 + max((floor(b) for b in below), default=0)
        return memo[g]

    return {v: floor(group[v]) for v in edges}


def is_command(name):
    return name in COMMANDS or "/" in name


def breaches(edges):
    """Every broken rule, one line each."""
    found = [f"circle: {' -> '.join(c)}" for c in circles(edges)]
    fl = floors(edges)
    top = max(fl.values())
    if top > MAX_FLOORS:
        found.append(f"{top} floors (at most {MAX_FLOORS}): " + ", ".join(sorted(v for v in fl if fl[v] == top)))
    for v in sorted(edges):
        for w in sorted(edges[v]):
            if w == "train" and v not in TRAINER_USERS:
                found.append(f"{v} imports train (only {', '.join(sorted(TRAINER_USERS))} may)")
            elif is_command(w) and not is_command(v):
                found.append(f"library {v} imports the command line {w}")
    return found


def main(argv):
    edges = graph()
    fl = floors(edges)
    if "--check" not in argv:
        for level in range(max(fl.values()), 0, -1):
            for v in sorted(m for m in fl if fl[m] == level):
                kind = "command" if is_command(v) else "library"
                print(f"floor {level}  {v:32s} {kind:8s} -> {', '.join(sorted(edges[v])) or '-'}")
    found = breaches(edges)
    for line in found:
        print(f"breach: {line}")
    print(f"{len(edges)} modules, {max(fl.values())} floors, {len(circles(edges))} circles, {len(found)} breaches")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
