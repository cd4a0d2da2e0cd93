"""README.md: the CI runs its test command, its file table lists every module, its links resolve, its snippet runs."""

import pytest
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


def test_the_readmes_python_snippet_runs_verbatim(tmp_path):
    """README's "From Python" block, exactly as printed, against a run folder of the Quick start's name
    (a few steps on text that has the prompt's characters)."""
    import os
    import subprocess
    import sys

    import train
    from conftest import TINY_RUN, make_text
    from dataset import prepare_text
    from tokenizer import char_tokenizer_for

    text = make_text(20_000) + "\nROMEO:\n"
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "data"))
    train.main([*TINY_RUN, f"--dataset={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out-shakespeare-char-cpu'}", "--max_iters=5"])
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## From Python") :]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start : section.index("\n```", start)]
    assert "load_any" in snippet
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ROMEO:") and len(done.stdout) > len("ROMEO:") + 50, done.stdout
    # GPT.from_pretrained reads Hugging Face folders only; a run's folder gets one line naming load_any
    from hf import PretrainedError
    from model import GPT

    run = str(tmp_path / "out-shakespeare-char-cpu")
    with pytest.raises(PretrainedError, match=r"no config.json.*checkpoint.load_any"):
        GPT.from_pretrained(run)
