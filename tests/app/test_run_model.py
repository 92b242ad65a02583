"""`tfdp.app.run_model.finished_run`: what `tfdp-predict` accepts as a finished run.

The whole command, on a real run, is in `test_predict_cli.py` (slow: it
trains first); these are its refusals, in-process and without training.
"""

import json

import pytest

from tfdp.app import run_model


def test_a_missing_directory_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(run_model.UsageError, match=r"--model_dir=.*/absent does not exist"):
        run_model.finished_run(str(tmp_path / "absent"))


def test_a_directory_without_summary_is_not_a_finished_run(tmp_path):
    with pytest.raises(run_model.UsageError, match="holds no finished tfdp-train run"):
        run_model.finished_run(str(tmp_path))


def test_a_summary_without_the_final_checkpoint_is_refused(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"config": {"model": "cnn"}}))
    with pytest.raises(run_model.UsageError, match="no checkpoint of the final weights"):
        run_model.finished_run(str(tmp_path))


def test_a_summary_of_something_else_is_refused_and_a_finished_run_is_read(tmp_path):
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    (tmp_path / "summary.json").write_text(json.dumps({"eval": {}}))
    with pytest.raises(run_model.UsageError, match=r"is not a tfdp-train summary \(no config.model\)"):
        run_model.finished_run(str(tmp_path))
    summary = {"config": {"model": "cnn", "dataset": "digits"}, "steps": 220}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert run_model.finished_run(str(tmp_path)) == summary
