"""--data files that are not UTF-8 text are refused in one line naming the file and the first bad byte,
never decoded with replacement characters and trained on."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.data.corpus import read_user_corpus
from refusals import refused, snapshot

GOOD = b"to be or not to be, that is the question\n" * 20
LATIN1_TEXT = b"hello\nwor\xe9ld\n"  # Latin-1 "é" (0xE9) at line 2, column 4
ZIP_HEADER = b"PK\x03\x04\x14\x00\x00\x00\x08\x00"  # valid UTF-8 up to its NUL at column 6


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "moetrain-cache"))


def _train(data: Path, metrics: Path) -> list[str]:
    # a batch of one sequence: a lone bad file of a few bytes could not hold more, and that would be refused first
    return ["train", "--data", str(data), "--steps", "2", "--global-batch", "1", "--micro-batch", "1",
            "--seq-len", "32", "--threads", "1", "--quiet", "--metrics-out", str(metrics)]


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("latin1.txt", LATIN1_TEXT, "is not UTF-8 text: byte 0xe9 at line 2, column 4; convert it to UTF-8 "
                                    "(e.g. iconv -f latin1 -t utf-8) or move it out of --data"),
        ("archive.txt", ZIP_HEADER, "holds a NUL byte at line 1, column 6, so it is binary, not text; give .txt or "
                                    ".jsonl text files only, or move it out of --data"),
        ("rows.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xe9"}\n', "byte 0xe9 at line 3, column 14"),
    ],
)
def test_undecodable_data_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          name: str, content: bytes, expected: str) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "good.txt").write_bytes(GOOD)
    (folder / name).write_bytes(content)
    before = snapshot(folder)
    metrics = tmp_path / "metrics.jsonl"
    # the bad file alone, and inside a folder of good ones: both name the bad file
    for data in (folder / name, folder):
        refused(capsys, _train(data, metrics), f"--data file {folder / name} ", expected)
    assert snapshot(folder) == before and not metrics.exists()


def test_jsonl_row_with_an_unpaired_surrogate_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"text": "fine"}\n{"text": "half a pair \\ud800"}\n')
    refused(capsys, _train(rows, tmp_path / "m.jsonl"),
            f"{rows}:2: 'text' holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which is no character; "
            "fix or drop that row")


def test_utf8_text_reads_as_before(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\r\nline two\n")  # a byte-order mark is dropped, not trained on
    rows = tmp_path / "b.jsonl"
    rows.write_bytes(b'{"text": "x\xe2\x80\xa8y"}\r\n\n{"text": "z"}\n')  # U+2028 raw inside a JSON string
    docs = read_user_corpus(str(tmp_path))
    assert [(d.name, d.text) for d in docs] == [("a.txt", "café\r\nline two\n"), ("b.jsonl:1", "x\u2028y"),
                                                ("b.jsonl:3", "z")]
