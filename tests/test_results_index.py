"""benchmarks/README.md indexes every benchmark and every result, and names nothing that is not there.

A name counts when it stands in backticks: a script as ``step_speed.py`` or ``benchmarks/step_speed.py``,
a result by its path under ``benchmarks/results/`` (``gpu_logs/tests_h200_7b5f6aa.log``), with or without
that prefix; a word inside a backticked command counts too. Names with ``*``, ``{``, ``$`` or ``<`` are
patterns, not files, and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
README = BENCHMARKS / "README.md"
FILE = re.compile(r"\.(?:py|sh|json|jsonl|png|log|yaml|csv|md)$")


def _named() -> set[str]:
    """The file-like words in the README's backticks, as written (a folder keeps its trailing ``/``)."""
    words = set()
    for span in re.findall(r"`([^`\n]+)`", README.read_text()):
        for word in span.split():
            word = word.strip("()[],;:\"'")
            if FILE.search(word) or word.endswith("/"):
                words.add(word)
    return {w for w in words if not any(c in w for c in "*{$<")}


def _short(word: str) -> str:
    """A name relative to benchmarks/results/ or benchmarks/, as the tables write it."""
    for prefix in ("benchmarks/results/", "results/", "benchmarks/"):
        if word.startswith(prefix):
            return word[len(prefix):]
    return word


def test_every_script_and_result_is_in_the_index() -> None:
    named = {_short(w).rstrip("/") for w in _named()}
    scripts = [p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")]
    results = [str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")]
    assert sorted(n for n in scripts + results if n not in named) == []


def test_every_file_the_index_names_exists() -> None:
    def exists(word: str) -> bool:
        if word.startswith("benchmarks/"):
            return (ROOT / word).exists()
        return any((base / word).exists() for base in (RESULTS, BENCHMARKS, ROOT))

    assert sorted(w for w in _named() if not exists(w)) == []
