"""Helper for the tests of a script under benchmarks/ or tools/: the script loaded as a module by its path
(the scripts are not a package), so that a test calls its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """The script at ``relative_path`` from the repository root, executed as a module (its ``main`` not run)."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if str(path.parent) not in sys.path:  # as when it runs: the modules beside it import (``_record``)
        sys.path.insert(0, str(path.parent))
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve a class's module by name while it executes
    spec.loader.exec_module(module)
    return module
