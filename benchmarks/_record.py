"""Provenance for benchmark results: the command, the commit and the machine behind every number.

Every file under ``benchmarks/results/`` carries ``command`` (what to run, from the repository root, to
write it again), ``commit`` (the code it ran) and ``machine`` (an object: platform, Python, torch, threads,
device). JSON results carry them as top-level keys (``write_result``); JSONL files (routing traces) as
their first line (``provenance_line``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
"""Result files: rewriting them does not make the code that wrote them differ from the commit."""


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "processor": platform.machine()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name()
        else:
            info["device"] = "cpu"
    except ImportError:
        pass
    return info


def device_tag() -> str:
    """A short name of this machine's accelerator for result file names: ``h200``, ``h100``, ... (the
    words of the GPU's name that a model number starts), or ``cpu``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name().replace("NVIDIA", "").split()
    model = next((w for w in words if any(c.isdigit() for c in w)), words[0] if words else "gpu")
    return model.lower()


def commit() -> str:
    """The checkout's commit, with ``-dirty`` when code differs from it (changed or new files outside
    ``benchmarks/results/``: a benchmark rewriting its results, or another's, leaves the code as
    committed); ``$MOETRAIN_COMMIT`` where the tree is a copy without its git history (a rented GPU
    machine)."""
    if os.environ.get("MOETRAIN_COMMIT"):
        return os.environ["MOETRAIN_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", ".",
                                f":(exclude){RESULTS}"], capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance() -> dict:
    """``command``, ``commit``, ``machine`` and ``time`` of this run."""
    return {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit(),
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(path: str | Path, result: dict) -> None:
    """``result`` as JSON at ``path``, its provenance first."""
    record = {**provenance(), **result}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def provenance_line() -> str:
    """The first line of a JSONL result: its provenance, under ``provenance`` so that readers of the
    rows (``moetrain.balance.traces.read_trace``) can tell it from them."""
    return json.dumps({"provenance": provenance()}, separators=(",", ":")) + "\n"
