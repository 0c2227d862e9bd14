"""Helper for the recovery tests: every tensor of a DCP checkpoint, whole, by its dotted name."""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_tensors(checkpoint: Path, out: Path) -> dict:
    """The checkpoint through DCP's own conversion to one torch file (written to ``out``), flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    flat = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        else:
            flat[prefix.rstrip(".")] = value

    walk(torch.load(out, weights_only=False), "")
    return flat
