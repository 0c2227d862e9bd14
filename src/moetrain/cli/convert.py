"""``moetrain convert``: Hugging Face folder ↔ moetrain training checkpoint.

    moetrain convert --from-hf DIR --to CKPT_DIR      # then: moetrain train --model CKPT_DIR/model.yaml
                                                      #       --save-dir CKPT_DIR --resume ...
    moetrain convert --to-hf CKPT_DIR --out DIR       # newest checkpoint → config.json + safetensors
                                                      # (+ modeling code for Pangu-style models)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from moetrain.cli.parsing import add_renamed_flag
from moetrain.errors import UserError

HELP = ("convert Hugging Face checkpoints (deepseek_v3, qwen3_moe, mixtral, and Pangu-style moetrain_pangu with its "
        "own modeling code) to and from moetrain checkpoints")

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_HF_MODEL_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json")
"""What an exported folder holds: an --out that holds any of it is refused, never overwritten."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="Hugging Face model folder (config.json + safetensors)")
    direction.add_argument("--to-hf", metavar="CKPT_DIR",
                           help="moetrain checkpoint folder (a --save-dir, or one step-NNNNNN folder in it)")
    parser.add_argument("--to", metavar="CKPT_DIR", help="with --from-hf: the checkpoint folder to create, new or "
                        "empty (one that holds checkpoints or a model.yaml is refused, never overwritten)")
    parser.add_argument("--out", metavar="DIR", help="with --to-hf: the Hugging Face folder to write, new or without "
                        "a model (one that holds config.json or safetensors is refused, never overwritten)")
    parser.add_argument("--model", help="with --to-hf: the run's model preset or YAML (default: the model the "
                                        "checkpoint records)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="with --to-hf: weight dtype written (default: the checkpoint's, fp32)")
    shard = parser.add_argument("--max-shard-gib", type=float, default=5.0,
                                help="with --to-hf: safetensors shard size in GiB")
    add_renamed_flag(parser, "--max-shard-gb", shard)


def run(args: argparse.Namespace) -> int:
    if args.from_hf:
        if not args.to:
            raise UserError("--from-hf needs --to CKPT_DIR (the moetrain checkpoint folder to create)")
        if args.out or args.model or args.dtype:
            raise UserError("--out, --model and --dtype go with --to-hf, not --from-hf")
        _check_checkpoint_target(args.to)
        return _from_hf(args)
    if not args.out:
        raise UserError("--to-hf needs --out DIR (the Hugging Face folder to write)")
    if args.to:
        raise UserError("--to goes with --from-hf; with --to-hf give --out")
    if args.max_shard_gib <= 0:
        raise UserError(f"--max-shard-gib {args.max_shard_gib} must be > 0")
    _check_hf_target(args.out)
    return _to_hf(args)


def _output_folder(path: str, flag: str) -> Path:
    """Refuse, before anything is read, an output folder that cannot be made: a file, a path through a file,
    an unwritable place (the folder itself is created when the weights are written)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; name a new folder to write into")
    nearest = next(p for p in (folder, *folder.parents) if p.exists())
    if not nearest.is_dir():
        raise UserError(f"{flag} {path}: {nearest} is a file, not a folder; choose another path")
    if not os.access(nearest, os.W_OK):
        raise UserError(f"{flag} {path}: {nearest} is not writable; choose a writable path")
    return folder


def _check_checkpoint_target(path: str) -> None:
    # lazy, heavy: the module imports torch; the refusal still comes before the model loads
    from moetrain.hf.converted_checkpoint import check_convert_target

    check_convert_target(_output_folder(path, "--to"), f"--to {path}")


def _check_hf_target(path: str) -> None:
    folder = _output_folder(path, "--out")
    held = sorted({f.name for pattern in _HF_MODEL_FILES for f in folder.glob(pattern)}) if folder.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise UserError(f"--out {path} already holds a Hugging Face model ({shown}); export into a new or empty "
                        "folder, or delete those files first")


def _from_hf(args: argparse.Namespace) -> int:
    # lazy, heavy: torch and the model load when the command runs, not when the parser imports every command
    # module (``moetrain.cli``)
    from moetrain.hf import load_pretrained
    from moetrain.hf.converted_checkpoint import MODEL_YAML, write_converted_checkpoint

    model, cfg = load_pretrained(args.from_hf)
    step_folder = write_converted_checkpoint(model, cfg, args.to)
    print(f"wrote {step_folder} and {step_folder.parent / MODEL_YAML} ({cfg.name}); continue training with:\n"
          f"  moetrain train --model {step_folder.parent / MODEL_YAML} --save-dir {step_folder.parent} --resume")
    return 0


def _to_hf(args: argparse.Namespace) -> int:
    # lazy, heavy: torch and the model load when the command runs, not when the parser imports every command
    # module (``moetrain.cli``)
    import torch

    from moetrain.hf import pangu, save_pretrained
    from moetrain.hf.configs import hf_family_for
    from moetrain.hf.converted_checkpoint import read_checkpoint_model

    model, cfg = read_checkpoint_model(args.to_hf, args.model)
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    out = save_pretrained(model, args.out, dtype=dtype, max_shard_bytes=int(args.max_shard_gib * 1024**3))
    family = hf_family_for(cfg)
    print(f"wrote {out} ({cfg.name}, Hugging Face family {family})")
    if family == pangu.FAMILY:
        print("  its modeling code is in the folder: load it with "
              f"AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0
