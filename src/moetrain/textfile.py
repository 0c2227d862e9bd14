"""Reading the user's text files strictly: UTF-8 or a one-line ``UserError`` naming the first bad byte.

Every reader of user input (YAML configs and plans, validation CSVs, ``--data`` corpora) goes through
``read_text``, so that a Latin-1 or binary file is refused where it is read, with its line and column,
instead of surfacing as a ``UnicodeDecodeError`` traceback or being trained on as replacement characters;
the readers of one named file check it with ``require_file`` first, so that a folder is not called missing.
"""

from __future__ import annotations

from pathlib import Path

from moetrain.errors import UserError

_BOM = "\ufeff"


def _line_and_column(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and character column of byte ``offset``; everything before it decodes."""
    line_start = data.rfind(b"\n", 0, offset) + 1
    column = len(data[line_start:offset].decode("utf-8", errors="replace")) + 1
    return data.count(b"\n", 0, offset) + 1, column


def decode_text(data: bytes, source: str, mend: str, binary_mend: str | None = None) -> str:
    """``data`` as UTF-8 (a leading byte-order mark dropped). ``source`` names the file in the message
    ("model file m.yaml"), ``mend`` says how to fix an undecodable byte. With ``binary_mend``, a NUL
    byte is refused too: it is valid UTF-8 but no text file holds one, so the file is binary."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _line_and_column(data, exc.start)
        raise UserError(f"{source} is not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line}, column {column}; "
                        f"{mend}") from None
    if binary_mend is not None and "\0" in text:
        line, column = _line_and_column(data, data.index(b"\0"))
        raise UserError(f"{source} holds a NUL byte at line {line}, column {column}, so it is binary, not text; "
                        f"{binary_mend}")
    return text.removeprefix(_BOM)


def require_file(path: Path, what: str, mend: str) -> None:
    """Refuse in one line a ``path`` that is not a regular file, saying which it is: missing, a folder, or
    something else (a device, a pipe). ``what`` names it ("plan file 'p.yaml'"), ``mend`` says what to give."""
    if path.is_file():
        return
    state = ("is a folder, not a file" if path.is_dir() else "is not a regular file" if path.exists()
             else "does not exist")
    raise UserError(f"{what} {state}; {mend}")


def read_text(path: Path, source: str, mend: str, binary_mend: str | None = None) -> str:
    """The file at ``path`` decoded by ``decode_text``; an unreadable file is a one-line error too."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {source} ({exc.strerror or type(exc).__name__}); check the path and its "
                        "permissions") from None
    return decode_text(data, source, mend, binary_mend)
