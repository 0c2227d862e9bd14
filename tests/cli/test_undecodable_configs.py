"""Non-UTF-8 YAML given as --model, --cluster or --plan: one line naming the file and the first bad byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.config import load_model_config
from refusals import refused, snapshot

# Latin-1 "é" (0xE9) on line 2, column 10.
BAD_YAML = b"# a model\nname: caf\xe9-model\nhidden_size: 128\n"


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["model-info", "--model", "{f}"], "model file"),
        (["simulate", "--model", "tiny-pangu", "--cluster", "{f}", "--seq-len", "128", "--global-batch", "16",
          "--devices", "1"], "cluster file"),
        (["train", "--plan", "{f}", "--quiet"], "plan file"),
    ],
)
def test_undecodable_yaml_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  argv: list[str], kind: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(BAD_YAML)
    before = snapshot(tmp_path)
    refused(capsys, [a.replace("{f}", str(bad)) for a in argv],
            f"{kind} {bad} is not UTF-8 text: byte 0xe9 at line 2, column 10; save it as UTF-8")
    assert snapshot(tmp_path) == before


def test_a_byte_order_mark_is_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    # JSON is YAML: the preset's fields as one flow mapping, after a UTF-8 byte-order mark
    path.write_bytes(b"\xef\xbb\xbf" + load_model_config("tiny-pangu").model_copy(update={"name": "bom"})
                     .model_dump_json().encode())
    assert load_model_config(str(path)).name == "bom"
