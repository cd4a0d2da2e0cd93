from conftest import ROOT


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert f"\n{ci_command}\n" in readme, f"README.md must show the command .ci/run runs: {ci_command}"
