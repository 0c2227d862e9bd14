"""``moetrain convert``: Hugging Face folder ↔ moetrain training checkpoint.

    moetrain convert --from-hf DIR --to CKPT_DIR      # then: moetrain train --model CKPT_DIR/model.yaml
                                                      #       --save-dir CKPT_DIR --resume ...
    moetrain convert --to-hf CKPT_DIR --out DIR       # newest checkpoint → config.json + safetensors
                                                      # (+ modeling code for Pangu-style models)
"""

from __future__ import annotations

import argparse

from moetrain.cli.parsing import add_renamed_flag
from moetrain.errors import UserError

HELP = ("convert Hugging Face checkpoints (deepseek_v3, qwen3_moe, mixtral, and Pangu-style moetrain_pangu with its "
        "own modeling code) to and from moetrain checkpoints")

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="Hugging Face model folder (config.json + safetensors)")
    direction.add_argument("--to-hf", metavar="CKPT_DIR",
                           help="moetrain checkpoint folder (a --save-dir, or one step-NNNNNN folder in it)")
    parser.add_argument("--to", metavar="CKPT_DIR", help="with --from-hf: the new (empty) checkpoint folder")
    parser.add_argument("--out", metavar="DIR", help="with --to-hf: the Hugging Face folder to write")
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
        return _from_hf(args)
    if not args.out:
        raise UserError("--to-hf needs --out DIR (the Hugging Face folder to write)")
    if args.to:
        raise UserError("--to goes with --from-hf; with --to-hf give --out")
    if args.max_shard_gib <= 0:
        raise UserError(f"--max-shard-gib {args.max_shard_gib} must be > 0")
    return _to_hf(args)


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
