from conftest import ROOT


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert f"\n{ci_command}\n" in readme, f"README.md must show the command .ci/run runs: {ci_command}"


def anchors(markdown):
    """GitHub's anchors of a markdown file's headings."""
    import re

    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


def test_readme_lists_every_module_and_its_doc_links_resolve():
    import re

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## The files") : readme.index("## Training")]
    missing = [p.name for p in ROOT.glob("*.py") if f"`{p.name}`" not in table]
    assert not missing, f"README's file table omits {missing}"
    assert len(readme) < 12_000, "README.md is for users: keep it under 12,000 characters (details go to docs/)"
    for path, anchor in re.findall(r"\]\((docs/[\w.]+\.md)(?:#([\w-]+))?\)", readme):
        assert (ROOT / path).exists(), path
        assert anchor is None or anchor == "" or anchor in anchors((ROOT / path).read_text()), f"{path}#{anchor}"


def test_requirements_point_to_sections_that_exist():
    """A requirements file's pointer to a document's section, as (see FILE, "Section"), names a heading."""
    import re

    for requirements in ROOT.glob("requirements*.txt"):
        for path, heading in re.findall(r"\((?:see )?([\w./]+), \"([^\"]+)\"\)", requirements.read_text()):
            text = (ROOT / (path if path.endswith(".md") else f"{path}.md")).read_text()
            assert f"# {heading}\n" in text, f"{requirements.name} names {path}, \"{heading}\": no such section"
