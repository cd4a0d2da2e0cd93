"""configurator.py: every script's bad input through cli_main (one line, exit 2); config files, then overrides."""

import importlib

import pytest

import configurator
import train

# script -> argv with one bad key, in the script's own argument shape
BAD_KEY = {
    "train": ["--learning_rte=1e-3"],
    "sample": ["--temprature=0.5"],
    "eval": ["--strid=64"],
    "bench": ["train", "--n_layr=2"],
    "export": ["--hf_dri=x"],
    "ablate": ["study.py", "--out_dri=x"],
    "plot": ["out", "--outt=x.png"],
    "serve": ["--prot=8000"],
}


@pytest.mark.parametrize("script", sorted(BAD_KEY))
def test_a_bad_key_is_one_line_and_exit_2_through_cli_main(script, monkeypatch, capsys):
    through = []
    real_fail = configurator.fail

    def recording_fail(message):  # cli_main's exit: seen here, the error took the one path
        through.append(str(message))
        real_fail(message)

    monkeypatch.setattr(configurator, "fail", recording_fail)
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit:
        module.main(BAD_KEY[script])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(through) == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "unknown key" in err or "unknown: --outt=x.png" in err


def test_config_file_then_overrides_in_order(tmp_path):
    from configurator import parse

    config = tmp_path / "cfg.py"
    config.write_text("n_layer = 3\nlearning_rate = 1\n")
    values, explicit = parse(train.config_keys(), [str(config), "--n_layer=5"])
    assert values["n_layer"] == 5 and values["learning_rate"] == 1.0 and isinstance(values["learning_rate"], float)
    assert explicit == {"n_layer", "learning_rate"}
    assert values["batch_size"] == 12  # untouched default


def test_a_run_folder_given_as_a_config_file_says_out_dir(tmp_path):
    """`python sample.py out-x`: the folder is not a config file, and the line says what to write."""
    from conftest import run_main

    (tmp_path / "out-x").mkdir()
    result = run_main("sample.py", str(tmp_path / "out-x"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"is a folder, not a config file; for a run's folder write --out_dir={tmp_path / 'out-x'}" in result.stderr
