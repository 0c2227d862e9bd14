"""Check that no measured figure of a doc was lost when the doc was rewritten.

    python tools/figure_check.py REV docs/planner.md [docs/balance.md ...]   # REV: 4aa42cd, before the rewrite

For each doc, every figure of its text at git revision REV (a decimal, a number of two or more digits, or
one with a thousands comma) must still be findable: in the doc now, in the results index
(benchmarks/README.md) or in the measurement notes (benchmarks/notes/*.md). Prints, per doc, where its
figures are and the ones found nowhere; exits 1 if any is missing. Also counts how many of the figures
found only in the notes equal, within their rounding, some number of a result JSON (a weak check: a
one-decimal figure matches some number of the results most of the time).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = re.compile(r"(?<![\w.])[-−+]?\d[\d,]*(?:\.\d+)?")


def _numbers(obj: object, out: set[float]) -> None:
    if isinstance(obj, dict):
        for value in obj.values():
            _numbers(value, out)
    elif isinstance(obj, list):
        for value in obj:
            _numbers(value, out)
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out.add(abs(float(obj)))


def result_numbers() -> list[float]:
    out: set[float] = set()
    for path in (ROOT / "benchmarks" / "results").rglob("*.json"):
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            _numbers(json.loads(path.read_text()), out)
    return sorted(out)


def in_results(token: str, numbers: list[float]) -> bool:
    """``token`` (``6.4``, ``1,460,832``) equals a result number within its rounding, as is or as a percent."""
    value = float(token.replace(",", ""))
    decimals = len(token.split(".")[1]) if "." in token else 0
    for scale in (1.0, 0.01):
        target, tolerance = value * scale, 0.5 * 10 ** -decimals * scale * 1.0001
        if any(abs(n - target) <= tolerance for n in numbers):
            return True
    return False


def figures(text: str) -> list[str]:
    tokens = {t.lstrip("+-−") for t in NUM.findall(text)}
    return sorted(t for t in tokens if "." in t or "," in t or (t.isdigit() and int(t) >= 10))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    revision, docs = argv[0], argv[1:]
    index = (ROOT / "benchmarks" / "README.md").read_text()
    notes = "\n".join(p.read_text() for p in sorted((ROOT / "benchmarks" / "notes").glob("*.md")))
    numbers = result_numbers()
    lost = 0
    for doc in docs:
        before = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{doc}"], capture_output=True,
                                text=True, check=True).stdout
        now = (ROOT / doc).read_text()
        counts = {"doc": 0, "index": 0, "notes": 0, "notes and a result JSON": 0}
        missing = []
        for token in figures(before):
            pattern = re.compile(r"(?<![\d.])" + re.escape(token) + r"(?![\d])")
            if pattern.search(now):
                counts["doc"] += 1
            elif pattern.search(index):
                counts["index"] += 1
            elif pattern.search(notes):
                counts["notes"] += 1
                counts["notes and a result JSON"] += in_results(token, numbers)
            else:
                missing.append(token)
        lost += len(missing)
        print(f"{doc}: {len(figures(before))} figures at {revision}; still in the doc {counts['doc']}, in the index "
              f"{counts['index']}, only in the notes {counts['notes']} (of which also a result JSON's number: "
              f"{counts['notes and a result JSON']}); missing {len(missing)} {' '.join(missing)}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
