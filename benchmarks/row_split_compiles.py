"""Which steps compile as the count of document-boundary rows changes from micro-batch to micro-batch.

    python benchmarks/row_split_compiles.py                     # → benchmarks/results/row_split_compiles_cpu.json
    python benchmarks/row_split_compiles.py --device cuda --counts 0,1,1,1,0,2,1,0,0,0,0

The runtime masks only the rows that hold a document boundary (``models.attention.core_attention``), so
their count is a shape of the compiled layers: a new count may compile again. This trains ``--model``
compiled, one micro-batch a step, on random tokens whose rows ``--counts`` says hold a boundary (step i: the
first ``counts[i]`` rows start a second document half-way), and records which steps compiled
(``distributed.parallelize.compile_events``) and how long each took. The GPU suite's time limits count on
what it finds: the count compiles at its first three values (0, 1, then once more as a dynamic size), and
never after.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import device_tag, write_result  # noqa: E402

from moetrain.config.run import RunSpec  # noqa: E402
from moetrain.data.packing import MicroBatch, StepBatch  # noqa: E402
from moetrain.distributed.parallelize import compile_events  # noqa: E402
from moetrain.distributed.step import train_step  # noqa: E402
from moetrain.train import SuppliedParts, Trainer  # noqa: E402

# The first 11 steps of the GPU suite's step_speed (pangu-shaped-small, seq 4096, micro-batches of 8:
# ``prepare_data(None, 2048, 4096, 1234)``) hold 0,1,1,1,0,2,1,0,0,0,0 boundary rows; 3 and the return to
# earlier counts test that nothing compiles after the count went dynamic.
DEFAULT_COUNTS = "0,1,1,1,0,2,1,0,3,2,1"


def step_batch(counts: int, rows: int, seq_len: int, vocab: int, generator: torch.Generator) -> StepBatch:
    """One micro-batch of ``rows`` random rows; the first ``counts`` start a second document half-way."""
    ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    documents = torch.zeros(rows, seq_len, dtype=torch.long)
    documents[:counts, seq_len // 2:] = 1
    micro = MicroBatch(input_ids=ids, labels=torch.roll(ids, -1, 1),
                       document_ids=documents if counts else None, num_label_tokens=rows * seq_len)
    return StepBatch([micro], rows * seq_len, rows * seq_len)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-pangu")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=8, help="rows of the one micro-batch a step")
    p.add_argument("--counts", default=DEFAULT_COUNTS, help="boundary rows per step, comma list")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/row_split_compiles_<device>.json)")
    args = p.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    if any(not 0 <= c <= args.rows for c in counts):
        raise SystemExit(f"--counts: each count must be 0..{args.rows} (--rows)")
    spec = RunSpec(model=args.model, training={"steps": len(counts), "global_batch": args.rows,
                                               "micro_batch": args.rows, "seq_len": args.seq_len},
                   run={"device": args.device, "quiet": True, "compile": True, "document_mask": "auto"})
    trainer = Trainer(spec, SuppliedParts(console=Console(file=io.StringIO())))
    generator = torch.Generator().manual_seed(0)
    steps = []
    for step, count in enumerate(counts):
        batch = step_batch(count, args.rows, args.seq_len, trainer.run.model_cfg.vocab_size, generator)
        before, start = compile_events(), time.perf_counter()
        train_step(trainer.run, step, batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        steps.append({"boundary_rows": count, "compiled": compile_events() > before,
                      "seconds": round(time.perf_counter() - start, 3)})
        print(f"step {step}: {count} boundary rows, {'compiled' if steps[-1]['compiled'] else 'no compile'}, "
              f"{steps[-1]['seconds']:.2f} s", flush=True)
    trainer.close()
    out = args.out or f"benchmarks/results/row_split_compiles_{device_tag()}.json"
    write_result(out, {"model": args.model, "device": args.device, "seq_len": args.seq_len, "rows": args.rows,
                       "document_mask": trainer.run.document_mask, "steps": steps,
                       "compiled_at_counts": [s["boundary_rows"] for s in steps if s["compiled"]]})


if __name__ == "__main__":
    main()
