"""Every script's bad input goes through configurator.cli_main: one line on stderr, exit status 2."""

import builtins
import importlib
import os

import pytest

import configurator
from conftest import run_script

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


def test_ablate_with_gpt2_offline_is_one_line(tmp_path, char_dataset):
    """init_from=gpt2 without network or a Hugging Face cache: PretrainedError, a UserError like any other."""
    study = tmp_path / "study.py"
    study.write_text(f"base = dict(dataset={char_dataset!r}, init_from='gpt2', max_iters=2, eval_interval=2, "
                     "eval_iters=1, batch_size=2, device='cpu', dtype='float32')\nvariants = {'gpt2': {}}\n")
    result = run_script("ablate.py", str(study), f"--out_dir={tmp_path / 'out'}",
                        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: variant 'gpt2' seed 1337: could not download 'gpt2'"), result.stderr
    assert "Traceback" not in result.stderr


def test_run_lock_without_fcntl(tmp_path, monkeypatch):
    """Where fcntl does not exist (Windows) the lock is skipped, and says it took nothing over."""
    from checkpoint import RunLock

    real_import = builtins.__import__

    def no_fcntl(name, *args, **kwargs):
        if name == "fcntl":
            raise ImportError("No module named 'fcntl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fcntl)
    lock = RunLock(str(tmp_path / "run")).acquire()
    assert lock.took_over is None and os.path.isdir(tmp_path / "run")
    lock.release()


def test_bench_json_is_written_atomically(tmp_path, monkeypatch):
    """A failure while writing --json leaves the previous file whole (the write goes to a temporary file
    that is renamed over it), as eval.py's --json."""
    import bench
    import dataset

    path = tmp_path / "bench.json"
    path.write_text('{"previous": true}')

    def failing_dumps(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dataset.json, "dumps", failing_dumps)
    with pytest.raises(OSError):
        bench.main(["train", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--vocab_size=32",
                    "--batch_size=2", "--rounds=1", "--steps=1", "--warmup=0", "--device=cpu", "--dtype=float32",
                    f"--json={path}"])
    assert path.read_text() == '{"previous": true}' and os.listdir(tmp_path) == ["bench.json"]
