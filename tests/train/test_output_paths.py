"""``check_output_paths``: a folder that takes no new file is refused before any step, even where
``os.access`` says it is writable (as it does for root, e.g. on ``/proc``), and only one rank a node tries."""

from __future__ import annotations

import pytest

from moetrain.config.run import RunOptions, RunSpec
from moetrain.errors import UserError
from moetrain.train.checks import check_output_paths


def _spec(folder) -> RunSpec:
    return RunSpec(run=RunOptions(save_dir=str(folder)))


def test_a_folder_that_takes_no_file_is_refused_though_access_says_writable(monkeypatch):
    monkeypatch.setattr("moetrain.train.checks._writable", lambda path: True)  # what os.access tells root
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(UserError, match=r"^--save-dir /proc: cannot create files in it \(.+\); choose a "
                                        r"writable folder$"):
        check_output_paths(_spec("/proc"))


def test_the_probe_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    check_output_paths(_spec(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt").is_dir() and list((tmp_path / "ckpt").iterdir()) == []


def test_only_local_rank_zero_creates_a_file_to_check(tmp_path, monkeypatch):
    created = []
    monkeypatch.setattr("moetrain.train.checks._cannot_create_in", lambda folder: created.append(folder))
    monkeypatch.setenv("LOCAL_RANK", "3")
    check_output_paths(_spec(tmp_path / "ckpt"))
    assert created == []
    monkeypatch.setenv("LOCAL_RANK", "0")
    check_output_paths(_spec(tmp_path / "ckpt"))
    assert created == [tmp_path / "ckpt"]
