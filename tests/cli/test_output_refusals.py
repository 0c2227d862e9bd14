"""Figure outputs (``simulate --timeline``, ``rl --plot``): a suffix matplotlib cannot write is refused in
one line before the work that draws it (matplotlib would fail after it, or without a suffix write
PATH.png instead of PATH), with the suffixes it can write."""

from __future__ import annotations

import pytest

from moetrain.rl.plot import figure_formats
from refusals import refused, refused_within

SUFFIXES = ", ".join(f".{suffix}" for suffix in figure_formats())
"""matplotlib's own list (Pillow's formats in it vary with the install): .avif, .eps, ..., .png, ..."""

SIMULATE = ["simulate", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--pp", "2", "--seq-len",
            "128", "--global-batch", "16"]
RL = ["rl", "--sft-steps", "0", "--steps", "1", "--prompts", "2", "--group-size", "2", "--eval-size", "4",
      "--device", "cpu", "--quiet"]


def test_the_listed_suffixes_are_matplotlibs() -> None:
    assert {"png", "pdf", "svg", "jpg"} <= set(figure_formats()) and "txt" not in figure_formats()


@pytest.mark.parametrize(("name", "problem", "example"), [
    ("tl.txt", "has the suffix .txt, which matplotlib cannot write", "tl.png"),
    ("tl", "has no suffix", "tl.png"),
])
def test_a_timeline_file_matplotlib_cannot_write_is_refused_first(tmp_path, capsys, name, problem, example) -> None:
    path = tmp_path / name
    refused_within(capsys, [*SIMULATE, "--timeline", str(path)],
                   f"--timeline {path} {problem}; end it in one of {SUFFIXES} (e.g. {tmp_path / example})")
    assert list(tmp_path.iterdir()) == []


def test_a_plot_file_matplotlib_cannot_write_is_refused_first(tmp_path, capsys) -> None:
    path = tmp_path / "plot.txt"
    refused_within(capsys, [*RL, "--plot", str(path)],
                   f"--plot {path} has the suffix .txt, which matplotlib cannot write; end it in one of {SUFFIXES} "
                   f"(e.g. {tmp_path / 'plot.png'})")
    # a folder where the file is meant: without this check savefig would write FOLDER.png beside it
    refused_within(capsys, [*RL, "--plot", str(tmp_path)],
                   f"--plot {tmp_path} is a folder; name a file, e.g. {tmp_path / 'reward.png'}")
    assert list(tmp_path.iterdir()) == []


def test_a_config_files_plot_is_checked_and_named(tmp_path, capsys) -> None:
    config = tmp_path / "rl.yaml"
    config.write_text(f"plot: {tmp_path / 'curve'}\n")
    refused_within(capsys, [*RL, "--config", str(config)],
                   f"--config {config}: plot {tmp_path / 'curve'} has no suffix; end it in one of {SUFFIXES} "
                   f"(e.g. {tmp_path / 'curve.png'})")


def test_the_plots_folder_is_made_before_the_run_as_save_dirs_is(tmp_path, capsys) -> None:
    plot = tmp_path / "figures" / "run1" / "reward.svg"
    refused(capsys, [*RL, "--plot", str(plot), "--from", str(tmp_path / "nowhere")], "--from", "no such file")
    assert plot.parent.is_dir() and not plot.exists()


def test_pgf_is_offered_only_where_its_tex_program_is(monkeypatch) -> None:
    monkeypatch.setattr("moetrain.rl.plot.shutil.which", lambda name: None)
    assert "pgf" not in figure_formats()  # matplotlib lists it, and fails after the work without xelatex
    monkeypatch.setattr("moetrain.rl.plot.shutil.which", lambda name: f"/usr/bin/{name}")
    assert "pgf" in figure_formats()
