"""Provenance for benchmark results: the command, the commit and the machine behind every number."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


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


def commit() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes); ``$MOETRAIN_COMMIT`` where the tree
    is a copy without its git history (a rented GPU machine)."""
    if os.environ.get("MOETRAIN_COMMIT"):
        return os.environ["MOETRAIN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(path: str | Path, result: dict) -> None:
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit(),
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **result,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
