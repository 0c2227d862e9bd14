"""Simulator vs runtime on this machine: profile the device, train a model a few steps, and compare
the measured step time with ``moetrain simulate`` using the profiled calibration.

    python benchmarks/planner_step_check.py [--steps 8]                  # CPU, tiny-pangu, fp32
    python benchmarks/planner_step_check.py --device cuda --steps 12      # one GPU, bf16
    python benchmarks/planner_step_check.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \
        --seq-len 4096 --global-batch 8 --micro-batch 1 --steps 8

    python benchmarks/planner_step_check.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \
        --seq-len 4096 --global-batch 8 --measured benchmarks/results/step_speed_h200.json \
        --variant compiled:8:block                        # the step measured there, not trained again

    python benchmarks/planner_step_check.py --device cuda --cluster h200-sxm-141gb \
        --model benchmarks/data/pangu-shaped-small.yaml --seq-len 4096 --global-batch 8 \
        --measured benchmarks/results/step_speed_h200.json --variant compiled:8:block \
        --calibration benchmarks/results/planner_step_check_h200_pangu-shaped-small.json \
        --out benchmarks/results/planner_step_check_h200_pangu-shaped-small_repriced.json
                                       # that check re-priced on any machine, with the profile it recorded

The trainer's defaults (moetrain.config.TrainingConfig: global batch 16, micro-batch 4, seq 128) are
passed explicitly to both sides so that they describe the same step: fp32 on CPU, bf16 autocast on
CUDA (``--precision bf16`` for the simulator). ``--measured`` takes the measured step from a
``step_speed.py`` result (its variant's micro-batch and median step) instead of training again, and with
it the device time by kind of kernel, which the check sets against the simulator's terms (``terms``,
which add up to the simulated step: the experts' grouped GEMMs; the fused attention core; the dense
GEMMs of projections, router, shared experts, dense FFN and head; element-wise kernels; the optimizer;
what the device did not fill; the rest). Writes
``benchmarks/results/planner_step_check_<device>[_<model>].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import device_tag, write_result  # noqa: E402


def _moetrain(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "moetrain", *args], check=True, capture_output=True,
                          text=True).stdout


def measured_step(path: str, variants: str) -> tuple[dict, dict]:
    """(the record, its row) of a ``step_speed.py`` result: the first of ``variants`` (comma list) it holds."""
    record = json.loads(Path(path).read_text())
    rows = {row["variant"]: row for row in record["variants"]}
    for variant in variants.split(","):
        if variant in rows:
            return record, rows[variant]
    raise SystemExit(f"{path} has none of the variants {variants!r}; it has {sorted(rows)}")


OPTIMIZER_RANGE = re.compile(r"^Optimizer\.\w+#\w+\.\w+$")
"""The name of the range torch's optimizer opens around its step (``Optimizer.step#AdamW.step``)."""


def kernel_ms_by_kind(record: dict, row: dict) -> dict[str, float]:
    """A step_speed row's device milliseconds by kind of kernel. A record from before ``device_time`` was
    written counted the optimizer's own range, which spans the optimizer's kernels, as one more optimizer
    kernel; that range, as the row's ``top_kernels`` lists it, is taken back out."""
    by_kind = dict(row["device_ms_by_kind"])
    if "device_time" not in record:
        for kernel in row.get("top_kernels", []):
            if OPTIMIZER_RANGE.match(kernel["name"]):
                by_kind[kernel["kind"]] = round(by_kind[kernel["kind"]] - kernel["device_ms"], 3)
    return by_kind


def compare_terms(simulated: dict, measured_s: float, device_ms_by_kind: dict[str, float]) -> list[dict]:
    """The simulated step (``moetrain simulate --json``) term by term against the measured device time of
    the kinds of kernel that run each term (``gpu_step_profile.KERNEL_KINDS``). The simulated terms add up
    to the simulated step: what no kind of kernel runs (communication, the pipeline bubble, MTP modules,
    the per-step overhead) is the last row, ``other``, measured as 0 on one device."""
    compute = simulated["compute_s"]
    part = lambda name: compute.get(name, 0.0)  # noqa: E731  (parts the model has not are absent)
    kinds = {kind: ms / 1e3 for kind, ms in device_ms_by_kind.items()}
    busy = sum(kinds.values())
    core = simulated["attention_core_s"]
    rows = [
        ("experts (grouped GEMMs)", part("experts"), kinds.get("grouped_gemm", 0.0)),
        ("fused attention core", core, kinds.get("attention", 0.0)),
        ("dense GEMMs", part("attention") - core + part("router") + part("shared_experts") + part("dense_ffn")
         + part("head"), kinds.get("gemm", 0.0)),
        ("element-wise", part("elementwise") + part("embed") + part("fp8_casts"),
         kinds.get("elementwise", 0.0) + kinds.get("copy", 0.0)),
        # the optimizer step as priced, no faster than the profile's timing of the trainer's whole update, which
        # on a GPU is the device's own time (the simulator books what it has beyond the device formula as the
        # host's, ``host_wait_s``: taken out of the idle row below)
        ("optimizer", simulated["optimizer_s"], kinds.get("optimizer", 0.0)),
        # the layers' wait for the host, and the MoE layer's fixed cost: the device idling while the host issues
        # the pass after the dispatch's count sync (``layer_costs.moe_pass_seconds``)
        ("device idle (host-bound)",
         simulated["host_wait_s"] - (simulated["optimizer_s"] - simulated["optimizer_device_s"]) + part("moe_fixed"),
         max(0.0, measured_s - busy)),
    ]
    named = sum(sim for _, sim, _ in rows)
    rows.append(("other (communication, bubble, MTP)", simulated["step_time_s"] - named, 0.0))
    return [{"term": term, "simulated_s": sim, "measured_s": meas, "miss_s": sim - meas} for term, sim, meas in rows]


def corpus_document_tokens(model: str) -> float:
    """Mean document length in tokens (EOS included) of the embedded corpus under ``model``'s vocabulary: what
    a step_speed record older than its ``document_tokens_mean`` trained on."""
    from moetrain.config import load_model_config
    from moetrain.data.prepare import prepare_data

    data = prepare_data(None, load_model_config(model).vocab_size, seq_len=1, seed=0)
    return data.dataset.stream.mean_document_tokens


def document_flags(model: str, measured_record: dict | None, measured_row: dict | None, device: str) -> list[str]:
    """``moetrain simulate``'s flags for the documents the measured step trained on: the corpus's, unless the
    step ran on synthetic data; its document mask as the run resolved it (the trainer's auto: block in
    compiled CUDA layers, dense elsewhere)."""
    if measured_record is not None and not str(measured_record.get("data", "shakespeare")).startswith("shakespeare"):
        return []
    tokens = (measured_row or {}).get("document_tokens_mean") or corpus_document_tokens(model)
    mask = (measured_row or {}).get("document_mask") or ("dense" if device == "cpu" else "block")
    return ["--document-tokens", f"{tokens:.1f}", "--document-mask", mask]


def masked_steps(row: dict, model: str, seq_len: int, global_batch: int) -> list[bool]:
    """Per step of a step_speed row (its ``steps_s``, then the profiled step): whether a micro-batch ran under
    the document mask. A record older than ``masked_steps`` is read again from the corpus: the batches are a
    function of the step and the trainer's seed (``data.packing``)."""
    if row.get("masked_steps"):
        return list(row["masked_steps"])
    from moetrain.config import TrainingConfig, load_model_config
    from moetrain.data.prepare import prepare_data

    data = prepare_data(None, load_model_config(model).vocab_size, seq_len, TrainingConfig().seed).dataset
    return [data.step_batch(step, global_batch, row["micro_batch"]).masked
            for step in range(len(row["steps_s"]) + 1)]


def timed_steps(row: dict, skip: int) -> list[int]:
    """The indices of the steps step_speed.py timed: not the first, none that compiled (``timed_steps_s``). A
    record older than ``compiled_steps`` does not say which compiled: its first ``skip`` steps are left out."""
    n = len(row["steps_s"])
    if not row.get("compiled_steps"):
        return list(range(max(skip, 1), n))
    return [i for i in range(1, n) if not row["compiled_steps"][i]] or list(range(1, n))


def steps_by_mask(row: dict, skip: int, masked: list[bool], plain_simulated_s: float) -> dict:
    """The timed steps split by whether they ran under the document mask; the plain ones against the step the
    simulator prices without documents, which is what they ran."""
    out = {}
    for kind, wanted in (("plain", False), ("masked", True)):
        steps = [i for i in timed_steps(row, skip) if masked[i] == wanted]
        times = [row["steps_s"][i] for i in steps]
        out[kind] = {"steps": steps, "steps_s": times, "median_s": statistics.median(times) if times else None}
    plain = out["plain"]
    plain["simulated_s"] = plain_simulated_s
    if plain["median_s"]:
        plain["error_pct"] = (plain_simulated_s - plain["median_s"]) / plain["median_s"] * 100
    out["profiled_step_masked"] = masked[len(row["steps_s"])]
    return out


def print_split_and_terms(by_mask: dict | None, terms: list[dict]) -> None:
    if by_mask is not None:
        plain, masked = by_mask["plain"], by_mask["masked"]
        if plain["median_s"]:
            print(f"  steps without a document mask {plain['steps']}: measured median {plain['median_s']:.4f} s, "
                  f"simulated without documents {plain['simulated_s']:.4f} s ({plain['error_pct']:+.1f}%)")
        if masked["median_s"]:
            print(f"  steps under the document mask {masked['steps']}: measured median {masked['median_s']:.4f} s")
        print(f"  the profiled step (the terms below) {'ran' if by_mask['profiled_step_masked'] else 'did not run'} "
              "under the document mask")
    for t in terms:
        print(f"  {t['term']:36s} simulated {t['simulated_s'] * 1e3:8.1f} ms  measured "
              f"{t['measured_s'] * 1e3:8.1f} ms  miss {t['miss_s'] * 1e3:+8.1f} ms")


def calibration_file(path: str, folder: str) -> str:
    """``path`` as a calibration file: a planner_step_check result gives the calibration it recorded (written
    into ``folder``); anything else is taken as a calibration file already."""
    if path.endswith(".json"):
        recorded = json.loads(Path(path).read_text()).get("calibration")
        if isinstance(recorded, str):
            out = Path(folder) / "recorded_calibration.yaml"
            out.write_text(recorded)
            return str(out)
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-pangu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--skip", type=int, default=2,
                        help="first steps left out (warm-up; with --measured, of a record that does not say which "
                             "steps compiled)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both profile and train (1 avoids OpenMP oversubscription "
                             "on a shared machine)")
    parser.add_argument("--profiles", type=int, default=None,
                        help="moetrain profile runs; the least disturbed (fastest GEMMs) prices the step (default: "
                             "3 on CPU, 1 on CUDA)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cluster", default=None, help="peaks the profile refers to (default: cpu, or the GPU's own "
                                                        "preset)")
    parser.add_argument("--measured", default=None, help="a step_speed.py result holding the measured step")
    parser.add_argument("--variant", default=None, help="with --measured: its variant (e.g. compiled:8:block; a comma "
                                                        "list: the first the result holds)")
    parser.add_argument("--calibration", default=None,
                        help="price the step with this calibration instead of profiling the device (with --measured "
                             "and --cluster: re-price a recorded check on any machine, e.g. the calibration a GPU "
                             "check recorded, saved to a file)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.calibration and not (args.measured and args.cluster):
        parser.error("--calibration re-prices a measured step: give --measured and --cluster too")
    return args


def main() -> None:
    args = parse_args()
    cuda = args.device == "cuda"
    if cuda and not args.cluster:
        import torch

        from moetrain.config import cluster_for_device

        device_cluster = cluster_for_device(torch.cuda.get_device_name())
    cluster = args.cluster or (device_cluster if cuda else "cpu")
    measured_record, measured_row = measured_step(args.measured, args.variant) if args.measured else (None, None)
    if measured_row is not None:
        args.micro_batch = measured_row["micro_batch"]
    dtype = "bf16" if cuda else "fp32"
    model_tag = "" if args.model == "tiny-pangu" else "_" + Path(args.model).stem
    out = args.out or f"benchmarks/results/planner_step_check_{device_tag()}{model_tag}.json"

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        load_before = os.getloadavg()[0]
        # The machine may be shared: profile several times and keep the least disturbed profile (the fastest
        # GEMMs), as rl_simulate_check.py does; every profile's GEMM efficiency is recorded.
        profiles = []
        for i in range(0 if args.calibration else args.profiles or (1 if cuda else 3)):
            out_i = str(Path(tmp) / f"profile{i}.yaml")
            measured_i = json.loads(_moetrain("profile", "--cluster", cluster, "--device", args.device, "--model",
                                              args.model, "--out", out_i, "--repeats", "7", "--threads",
                                              str(args.threads), "--json"))
            profiles.append((measured_i, out_i))
        profile, calibration = (max(profiles, key=lambda p: p[0]["efficiencies"]["gemm_max"]) if profiles
                                else ({"measurements": None}, calibration_file(args.calibration, tmp)))
        if measured_row is not None:
            measured_steps = [measured_row["steps_s"][i] for i in timed_steps(measured_row, args.skip)]
        else:
            _moetrain("train", "--model", args.model, "--cluster", cluster, "--steps", str(args.steps),
                      "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch), "--seq-len",
                      str(args.seq_len), "--device", args.device, "--dtype", dtype, "--threads", str(args.threads),
                      "--metrics-out", str(metrics), "--quiet")
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            measured_steps = [r["step_time_s"] for r in rows[args.skip:]]
        documents = document_flags(args.model, measured_record, measured_row, args.device)

        def simulate(*flags: str) -> dict:
            return json.loads(_moetrain(
                "simulate", "--model", args.model, "--cluster", cluster, "--devices", "1", "--seq-len",
                str(args.seq_len), "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
                "--dtype", dtype, "--calibration", calibration, *flags, "--json"))

        simulated = simulate(*documents)
        by_mask = None
        if measured_row is not None and documents:
            by_mask = steps_by_mask(measured_row, args.skip, masked_steps(measured_row, args.model, args.seq_len,
                                                                          args.global_batch), simulate()["step_time_s"])
        profiled = Path(calibration).read_text()
    measured = statistics.median(measured_steps)
    error = (simulated["step_time_s"] - measured) / measured * 100
    print(f"measured median step {measured:.4f} s, simulated {simulated['step_time_s']:.4f} s ({error:+.1f}%)")
    terms = []
    if measured_row is not None and measured_row.get("device_ms_by_kind"):
        terms = compare_terms(simulated, measured, kernel_ms_by_kind(measured_record, measured_row))
    print_split_and_terms(by_mask, terms)
    write_result(out, {
        "model": args.model,
        "device": args.device,
        "cluster": cluster,
        "precision": dtype,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "simulated": {k: simulated[k] for k in ("compute_s", "attention_core_s", "optimizer_s", "optimizer_device_s",
                                                "bubble_s", "host_wait_s", "memory_gib")},
        "calibration_from": args.calibration or "moetrain profile on this machine (this run)",
        "simulate_document_flags": documents,
        "steps_by_mask": by_mask,
        "measured_from": f"{args.measured} {measured_row['variant']}" if measured_row else "moetrain train (this run)",
        "measured_step_time_s": measured,
        "measured_steps_s": measured_steps,
        "simulated_step_time_s": simulated["step_time_s"],
        "error_pct": error,
        "terms": terms,
        "threads": args.threads,
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
        "calibration": profiled,
        "profile_measurements": profile["measurements"],
        "gemm_max_per_profile": [p[0]["efficiencies"]["gemm_max"] for p in profiles],
    })


if __name__ == "__main__":
    main()
