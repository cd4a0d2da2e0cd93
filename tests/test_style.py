"""The house's shape: the import graph (tools/imports.py) keeps its rules, and the docstrings on the card's
path open with a summary line. Both measured from the code, so a change that breaks them fails here."""

import ast
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import imports  # noqa: E402

CARD = ["model.py", "generate.py", "engine.py", "train.py", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "attention").glob("*.py"))]  # fmt: skip


def test_the_import_graph_has_no_circle_few_floors_and_no_library_on_a_command_line():
    edges = imports.graph()
    assert {"model", "attention", "engine", "tokenizer", "probes", "train"} <= set(edges)
    assert imports.breaches(edges) == []
    assert max(imports.floors(edges).values()) <= imports.MAX_FLOORS


def test_the_rules_catch_a_circle_a_tall_house_and_a_library_on_a_command_line():
    """The same rules on made-up graphs: each breach is named."""
    circle = {"model": {"checkpoint"}, "checkpoint": {"model"}, "train": {"model"}}
    assert imports.breaches(circle) == ["circle: checkpoint -> model"]
    tower = {f"m{i}": {f"m{i + 1}"} for i in range(imports.MAX_FLOORS)} | {f"m{imports.MAX_FLOORS}": set()}
    assert imports.breaches(tower) == [f"{imports.MAX_FLOORS + 1} floors (at most {imports.MAX_FLOORS}): m0"]
    leaning = {"model": {"sample"}, "sample": set(), "bench": {"train"}, "train": set()}
    assert imports.breaches(leaning) == ["bench imports train (only ablate may)", "library model imports the command line sample"]


def summary_line(doc):
    """Whether a docstring opens with one sentence and a blank line (PEP 257; a module's may start on the
    line after the quotes)."""
    lines = doc.split("\n")
    if not lines[0].strip():
        lines = lines[1:]
    return lines[0].strip().endswith(".") and (len(lines) == 1 or not lines[1].strip())


def test_docstrings_on_the_cards_path_open_with_a_summary_line():
    """At least 90% of the multi-line docstrings in the files a reader of the model takes in first."""
    found, missing = 0, []
    for name in CARD:
        tree = ast.parse((ROOT / name).read_text())
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]:
            doc = ast.get_docstring(node, clean=False)
            if doc and "\n" in doc.strip():
                found += 1
                if not summary_line(doc):
                    missing.append(f"{name}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '(module)')}")
    assert found >= 80 and len(missing) <= 0.1 * found, f"{len(missing)} of {found} have no summary line: {missing}"
