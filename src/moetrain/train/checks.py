"""Every check of a run spec that needs no process group, in one place, before any rank starts.

``moetrain train`` calls ``check_run`` before it trains in one process or starts torchrun; the worker
that users start with torchrun themselves calls it too, so a bad run is one line (exit 2) either way.
Torch-free: layout arithmetic, sizes against what they mean (the model's positions, the corpus, the
largest runs and this machine's cores: ``moetrain.config.limits``), flag combinations, and the files the
run will write. ``check_corpus`` (pre-training only, not RL) sets the global batch against the corpus.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from moetrain.balance.online import check_online_balance
from moetrain.config import ModelConfig, ParallelConfig, limits
from moetrain.config.run import RunSpec
from moetrain.data.corpus import check_data_path
from moetrain.data.size import corpus_size
from moetrain.distributed.layout import validate_layout
from moetrain.errors import UserError


def check_run(spec: RunSpec, model_cfg: ModelConfig) -> None:
    """Refuse what cannot run, naming the flag and how to mend it; create the output folders."""
    training, parallel, run = spec.training, spec.parallel, spec.run
    limits.check_batch_tokens(training.global_batch, training.seq_len)
    limits.check_run_tokens(training.steps, training.global_batch, training.seq_len)
    if run.threads is not None:
        limits.check_processes(run.threads, "--threads", "threads per rank")
    validate_layout(parallel, model_cfg, spec.world_size, training.global_batch, training.micro_batch,
                    run.ranks_per_node)
    check_seq_len(training.seq_len, parallel, model_cfg)
    _check_combinations(spec, model_cfg)
    if spec.balance.enabled:
        balance = spec.balance
        check_online_balance(parallel, model_cfg, balance.interval, balance.horizon, balance.slots_per_rank)
    check_output_paths(spec)


def check_seq_len(seq_len: int, parallel: ParallelConfig, model_cfg: ModelConfig) -> None:
    """The model's positions must reach the sequence; context parallelism cuts each sequence into 2·cp
    load-balanced chunks, and sequence parallelism splits each rank's share over the tp ranks."""
    limits.check_seq_len(seq_len, model_cfg.max_seq_len, model_cfg.name)
    if parallel.cp > 1 and seq_len % (2 * parallel.cp):
        raise UserError(f"--seq-len {seq_len} does not split into 2·cp = {2 * parallel.cp} context-parallel "
                        f"chunks; make it a multiple of {2 * parallel.cp}")
    if parallel.tp > 1 and (seq_len // parallel.cp) % parallel.tp:
        share = "" if parallel.cp == 1 else f" of each cp={parallel.cp} share ({seq_len // parallel.cp} tokens)"
        raise UserError(f"--seq-len {seq_len} does not split over tp={parallel.tp} sequence shards{share}")


def check_corpus(spec: RunSpec, model_cfg: ModelConfig) -> None:
    """The corpus must hold a global batch of sequences: refused with the numbers before the corpus is
    fetched or tokenized (``moetrain.data.size``: the count recorded by an earlier run, else a bound)."""
    run, training = spec.run, spec.training
    if run.synthetic_data:
        return
    if run.data is not None:
        check_data_path(run.data)
    size = corpus_size(run.data, model_cfg.vocab_size)
    sequences = size.sequences(training.seq_len)
    if sequences < 1 and size.exact:  # by the bound alone, a file's own defect (not UTF-8, say) names it better
        raise UserError(f"the corpus has {size.tokens:,} tokens, fewer than one sequence of --seq-len "
                        f"{training.seq_len} + 1; add text or lower --seq-len")
    if 0 < sequences < training.global_batch:
        holds = "has" if size.exact else "holds at most"
        raise UserError(f"--global-batch {training.global_batch} but the corpus {holds} {sequences:,} sequences of "
                        f"{training.seq_len} tokens; lower --global-batch to at most {sequences:,}, or add text "
                        "(--data)")


def _check_combinations(spec: RunSpec, model_cfg: ModelConfig) -> None:
    run, parallel = spec.run, spec.parallel
    if run.stop_at is not None and run.stop_at > spec.training.steps:
        raise UserError(f"--stop-at {run.stop_at} must lie in 1..--steps ({spec.training.steps})")
    if run.max_restarts > 0 and not run.save_dir:
        raise UserError(f"--max-restarts {run.max_restarts} needs --save-dir (each restart resumes from the newest "
                        "checkpoint there; add --save-every K to lose at most K steps)")
    # each flag below only means something with a checkpoint folder: without one it would be silently ignored
    checkpoint_flags = (("--stop-at", run.stop_at is not None), ("--resume", run.resume),
                        ("--save-every", run.save_every > 0), ("--async-save", run.async_save),
                        ("--keep-last", run.keep_last))
    given = [flag for flag, value in checkpoint_flags if value]
    if given and not run.save_dir:
        named = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        raise UserError(f"{named} need{'s' * (len(given) == 1)} --save-dir (the folder holding the checkpoints)")
    if run.synthetic_data and run.data:
        raise UserError("--synthetic-data and --data exclude each other; drop one")
    if run.trace_routing and model_cfg.moe is None:
        raise UserError(f"--trace-routing needs an MoE model; {model_cfg.name} has no MoE layers")
    if run.document_mask == "block" and run.device == "cpu":
        raise UserError("--document-mask block runs FlexAttention, which has no backward on cpu; "
                        "use --document-mask dense (or auto)")
    if parallel.zero >= 2 and parallel.overlap:
        raise UserError(f"ZeRO-{parallel.zero} does not run with the overlapped schedule yet; "
                        "use zero 1 or drop --overlap")
    if parallel.zero >= 2 and model_cfg.tie_embeddings:
        raise UserError(f"ZeRO-{parallel.zero} does not run with tied embeddings yet (the head reads the embedding "
                        "outside its module); use zero 1")


def check_output_paths(spec: RunSpec) -> None:
    """Create the folders the run writes into and refuse, before any work, a path that cannot be one:
    a file named as a folder, a folder named as a file, an unwritable place."""
    run = spec.run
    if run.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise UserError("--tensorboard needs the tensorboard package: pip install 'moetrain[tensorboard]' "
                        "(or drop --tensorboard; --metrics-out writes the same rows as JSONL)")
    for flag, folder in (("--save-dir", run.save_dir), ("--trace-dir", run.trace_dir),
                         ("--tensorboard", run.tensorboard), ("--log-dir", run.log_dir)):
        if folder is not None:
            _make_folder(Path(folder), flag)
    for flag, file in (("--metrics-out", run.metrics_out), ("--trace-routing", run.trace_routing)):
        if file is None:
            continue
        path = Path(file)
        if path.is_dir():
            raise UserError(f"{flag} {file} is a folder; name a file, e.g. {path / 'metrics.jsonl'}")
        _make_folder(path.parent, flag)
        if path.exists() and not _writable(path):
            raise UserError(f"{flag} {file} cannot be written; choose a writable path")


def _make_folder(folder: Path, flag: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{flag} {folder}: a file is in the way of that folder; choose another path") from None
    except NotADirectoryError:
        raise UserError(f"{flag} {folder}: a part of that path is a file, not a folder; choose another path") from None
    except OSError as exc:
        raise UserError(f"{flag} {folder}: cannot create it ({exc.strerror}); choose a writable path") from None
    if not _writable(folder):
        raise UserError(f"{flag} {folder} is not writable; choose a writable folder")
    # one probe a node: torchrun's other local ranks share this node's view of the folder, and thousands of
    # ranks creating files in one shared folder at start would load its file system for nothing
    if os.environ.get("LOCAL_RANK", "0") == "0" and (error := _cannot_create_in(folder)):
        raise UserError(f"{flag} {folder}: cannot create files in it ({error}); choose a writable folder")


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _cannot_create_in(folder: Path) -> str | None:
    """Why no file can be created in this folder, or None: ``os.access`` answers yes to root for folders
    such as ``/proc`` that refuse new files, so create one (under a name no other rank uses) and remove it."""
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".moetrain-write-check-")
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(handle)
    os.unlink(name)
    return None
