"""Write ``reference_predictions.json``: what the cost model predicts through the CLI, kept so that a
refactor of the cost model can prove it changed no prediction (``tests/planner/test_reference.py``).

Run from the repository root, with shared/validation/calibration.csv beside the checkout:

    PYTHONPATH=src python tests/planner/data/make_reference.py

It was run at commit 3e5f929, before ``costmodel.evaluate`` became typed functions, and rerun once since:
when the activation formula began to count the grouped GEMMs' int32 block offsets (4 bytes per local
expert and MoE layer), which moved 25 ``memory_gib`` values by under 1e-6 GiB and no time or winner.
Since then: when the MoE combine stopped keeping an fp32 copy of the expert output (the smaller MoE
activations moved three validate rows and the MoE searches' memory and winners), and when ranks
beyond a CPU host's cores began to share them (the 4-rank tiny-pangu search), and when CPU ranks began
to be priced as this runtime trains them with the shipped CPU profile (the same search), and when the in-node
fabric got its topology (issue 42: Ascend HCCS as a full mesh, where a group of q NPUs reaches q − 1 of 7 links,
which moved the Pangu search's winner off tp 2 / etp 2; GB200 NVL72 as one 72-GPU NVLink domain, which prices
the GB200 rows' traffic between trays on NVLink's bus efficiency instead of the network's: MBR-1 −1.0 %, MBR-3
−0.5 %, MBR-7 +0.004 %), and after the refit with those mechanisms (every validate row within 0.4 %; the DeepSeek-V3
search's winner changed between two layouts 0.02 % apart), and when the Atlas preset left the mesh off
until its per-link bandwidth is measured (the Pangu search again; no validate row moved), and after issue 42's
split weight gradients, adaptive recompute and last DP chunk with their refit (DSV3-1 +5.0 % before the refit;
the refit moves every row), and when the screen hid the paired all-to-all under the TP and CP traffic as
the timeline does (3f8338b: no validate row moved; the Qwen3 search's two tied first layouts swapped, the
DeepSeek-V3 winner 25.99 → 25.96 s), and when expert tensor parallelism began to price each device's experts
at the tokens its etp group gathers (planfit6: every search's winner had etp > 1 because the experts' work fell
as 1/etp; now Mixtral 8x7B FP8 on 64 H100 3.60 → 5.32 s, DeepSeek-V3 on 2,048 H800 25.96 → 27.42 s, etp 1 in
all but Mixtral; no validate row moved: none has etp > 1), and when the activation formula began to count
the rows the etp group gathers and the dispatch's int64 reorder indices (etpmem: the Mixtral FP8 winner,
tp 2 / etp 2, needs 84.19 GiB instead of 61.69 GiB and no longer fits; now etp 1, 5.32 → 5.70 s; the Qwen3
search's tied first layouts reordered; no validate row moved), and when it began to count the hierarchical
dispatcher's own tensors and to keep a device's own assignments off the load imbalance (moemem: DeepSeek-V3's
fifth layout, pp 8 / ep 64 hierarchical, needs 93.64 GiB instead of 64.58 GiB and no longer fits, pp 4 / ep 256
at 70.57 GiB takes its place; the Mixtral FP8 search at imbalance 1.3 keeps its times, its layouts 0.76-0.81 GiB
lighter and its tied first layouts reordered; the Qwen3 search's tied layouts reordered; no validate row moved),
and when the hierarchical combine stopped keeping its rows in fp32, weighted and after the second hop (hiercombine:
DeepSeek-V3's fifth layout is pp 8 / ep 64 hierarchical again, 27.10 s at 64.62 GiB, in place of pp 4 / ep 256 flat,
26.98 s at 70.57 GiB; the Qwen3 search's tied layouts reordered; no validate row moved), and when Blackwell's
attention began to pay its non-matmul work at twice Hopper's tensor-core rate, with the refit (bwattn: every
row moves, MBR-11 −2.3 % and MBR-4 +2.0 % the most; the Mixtral FP8 winner moves from cp 4 / micro-batch 4 to
cp 2 / micro-batch 2, the Qwen3 A100 winner to cp 1 / micro-batch 1, Pangu on 6,144 NPUs 7.187 → 7.031 s).
And when the paired schedule began to hide the fixed cost per MoE pass, with the refit (pairhide: DSV3-1 +1.6 %,
TT-6 −2.1 %, MBR-11 −1.5 %, every other validate row within 1 %; every GPU search's winner is an overlapped layout
with many micro-batches that now pays the pass cost on its unpaired units only: Pangu on 6,144 NPUs 7.031 → 6.250 s,
Mixtral FP8 5.65 → 4.44 s at tp 2 / etp 2, Qwen3 on 32 A100 8.88 → 7.11 s at pp 1 / ep 32 hierarchical, DeepSeek-V3
26.81 → 20.99 s at pp 4 / cp 8; the CPU search, whose host pays the cost itself, did not move).
Rerun it only when a prediction is meant to change, and say why in the commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CSV = next(p for p in (ROOT.parent / "shared/validation/calibration.csv",
                       ROOT / "shared/validation/calibration.csv") if p.is_file())

# Searches that cover a dense-first MoE with MTP on NPUs, a tiny CPU model, FP8 with routing
# imbalance, an MoE with shared experts at small scale, and every layout (--any-layout).
PLANS = {
    "pangu-718b-6144": ["--model", "pangu-ultra-moe-718b", "--cluster", "atlas-800t-a2", "--devices", "6144",
                        "--seq-len", "8192", "--global-batch", "1536"],
    "tiny-pangu-cpu4": ["--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--seq-len", "128",
                        "--global-batch", "16"],
    "mixtral-h100-64-fp8": ["--model", "mixtral-8x7b", "--cluster", "h100-sxm-80gb", "--devices", "64",
                            "--seq-len", "4096", "--global-batch", "512", "--precision", "fp8",
                            "--imbalance", "1.3"],
    "qwen3-30b-a100-32-any": ["--model", "qwen3-30b-a3b", "--cluster", "a100-sxm-80gb", "--devices", "32",
                              "--seq-len", "4096", "--global-batch", "256", "--any-layout"],
    "deepseek-v3-h800-2048": ["--model", "deepseek-v3-671b", "--cluster", "h800-sxm-80gb", "--devices", "2048",
                              "--seq-len", "4096", "--global-batch", "15360"],
}


def _moetrain(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return json.loads(out.stdout)


def main() -> None:
    validated = _moetrain("validate", str(CSV), "--json")
    plans = {}
    for name, flags in PLANS.items():
        summary = _moetrain("plan", *flags, "--top", "5", "--out", "/dev/null", "--json")
        plans[name] = {"flags": flags, "top": [
            {k: row[k] for k in ("parallel", "step_time_s", "mfu", "memory_gib")} for row in summary["top"]]}
    reference = {
        "note": "moetrain validate calibration.csv --json (shipped calibration) and moetrain plan --top 5 --json, "
                "at commit 3e5f929 (tests/planner/data/make_reference.py)",
        "validate": {row["id"]: row["predicted"] for row in validated["rows"]},
        "plan": plans,
    }
    (HERE / "reference_predictions.json").write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
