"""Published training runs as simulator inputs: read rows in the schema of shared/validation/README.md,
predict each row's metric, and score the predictions.

A row becomes a ``ModelConfig`` (the architecture columns), a ``ClusterConfig`` (the hardware table),
one strategy (the layout columns) and a ``Workload``. An empty vpp/ep/etp/cp is 1 (the README's
reading). For the other unknown cells the README says only that the source does not state them; this
module reads an empty micro-batch as 1, an empty ZeRO stage as 1, an empty sp as "on when tp > 1" and
an empty recompute as "none" (then the least that fits, below). Rows that lack what a prediction needs
(device count, sequence length, batch, TP/PP, a published peak) are returned as *unsimulable* with the
reason.

A row's ``source`` may describe the cluster's network more precisely than the hardware table (vTrain's
rows state "800 Gb/s inter-node per node", which the README's hardware table also gives for vTrain's
A100 cluster); ``_cluster_overrides`` reads that per-node network figure. The in-node figure those
rows quote ("150 GB/s intra-node") is vTrain's own modelling choice, not a property of the A100 SXM
part (NVLink 3: 300 GB/s per direction in the hardware table), so the hardware table's value stays.

The ``source`` also states mechanisms the model prices: a DualPipe / F&B-overlap schedule, which traffic
the stack overlaps ("with DP/TP/PP comm overlap", "AsyncTP", "MC2"), and GPT-OSS's alternating sliding-window
layers, and a MoE dispatch that pads the experts' inputs to a capacity ("experts padded to capacity
(capacity factor F)": no token-count sync, every expert computes F times the balanced load). A row
without a recompute cell gets the least recomputation that fits its device's memory
(``_lightest_recompute_that_fits``): the run ran, so it fit. FP8 rows store their linear layers' inputs
in FP8 unless the source names torchao; GPT-3-style models (learned absolute positions) and rows naming
ALiBi have no rotary pass. A source stating "gradients reduced in BF16" prices 2 B gradients. Stacks
after the fp16 era, and Megatron-DeepSpeed's fp16 runs, reduce the backward's column-parallel input
gradients under the weight-gradient GEMMs (``Workload.async_tp_input_grad``). torchtitan
pipeline rows that leave the micro-batches unstated take torchtitan's defaults (``_pipeline_split``).
Cells a row leaves empty but its run's released launch script states (the SC21 runs' micro-batch,
interleaving and DDP mode) are filled from that script first (``launch_facts``).
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import GQAConfig, MLAConfig, ModelConfig, MoEConfig, RouterConfig
from moetrain.config.presets import load_cluster_config
from moetrain.costs.flops import training_flops_per_token
from moetrain.errors import UserError, describe_validation_error
from moetrain.planner.calibration import Calibration, Efficiency
from moetrain.planner.costmodel import StepCosts, evaluate
from moetrain.planner.launch_facts import with_launch_facts
from moetrain.planner.strategy import A2A_NAMES, RECOMPUTE_NAMES, Strategies
from moetrain.planner.workload import Workload
from moetrain.textfile import read_text, require_file

METRICS = ("step_time_s", "tflops_per_device", "tokens_per_s_per_device", "mfu", "peak_memory_gib")
# Without any of these columns no row can be simulated (``prepare_row`` needs them all).
REQUIRED_COLUMNS = ("id", "attention", "ffn_act", "layers", "hidden", "heads", "vocab", "seq_len", "global_batch_seqs",
                    "hardware", "num_devices", "tp", "pp", "metric", "value")
# Cells read as whole numbers (``_int``); ``value`` is a positive finite number.
INTEGER_COLUMNS = ("layers", "dense_layers", "hidden", "ffn_hidden", "heads", "kv_heads", "head_dim", "q_lora_rank",
                   "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim", "num_experts", "topk",
                   "moe_ffn_hidden", "shared_experts", "vocab", "seq_len", "global_batch_seqs", "num_devices",
                   "devices_per_node", "tp", "sp", "pp", "vpp", "ep", "etp", "cp", "dp", "zero", "micro_batch")
# The whole numbers each cell may hold (least, most; None: no most). A size or a parallel degree is at least 1
# (a 0 divides the step by zero and predicts NaN); these count what a model may have none of; sp is a flag
# and zero a ZeRO stage (shared/validation/README.md).
INTEGER_BOUNDS: dict[str, tuple[int, int | None]] = {
    **{column: (1, None) for column in INTEGER_COLUMNS},
    **{column: (0, None) for column in ("dense_layers", "ffn_hidden", "q_lora_rank", "num_experts", "shared_experts")},
    "sp": (0, 1), "zero": (0, 3),
}
# Text cells with a fixed set of values (shared/validation/README.md); an empty one is read as the module
# docstring says.
CHOICE_COLUMNS: dict[str, tuple[str, ...]] = {
    "attention": ("mha", "gqa", "mla"), "ffn_act": ("gelu", "swiglu", "relu2"), "recompute": RECOMPUTE_NAMES,
    "precision": ("bf16", "fp16", "fp8"), "flops_convention": ("model", "hardware", "na"), "metric": METRICS,
}

# Hardware ids with a cluster preset of their own.
_PRESET_OF_HARDWARE = {
    "a100-sxm-80gb": "a100-sxm-80gb",
    "h100-sxm-80gb": "h100-sxm-80gb",
    "h800-sxm-80gb": "h800-sxm-80gb",
    "h200-sxm-141gb": "h200-sxm-141gb",
    "b200": "b200",
    "gb200": "gb200",
    "ascend-910b": "atlas-800t-a2",
}
# Hardware-table rows (shared/validation/README.md) without a preset.
_EXTRA_HARDWARE = {
    "a100-sxm-40gb": dict(peak_tflops_bf16=312, hbm_gb=40, hbm_bandwidth_tbps=1.555, devices_per_node=8,
                          intra_node_gbps=300, inter_node_gbps=25),
    "a800-sxm-80gb": dict(peak_tflops_bf16=312, hbm_gb=80, hbm_bandwidth_tbps=2.039, devices_per_node=8,
                          intra_node_gbps=200, inter_node_gbps=12.5),
}
# Published memory and links but no published peak: only memory rows can be simulated.
_MEMORY_ONLY_HARDWARE = {
    "h100-sxm-96gb": dict(peak_tflops_bf16=989.4, hbm_gb=96, hbm_bandwidth_tbps=2.4, devices_per_node=8,
                          intra_node_gbps=450, inter_node_gbps=50),
}


@dataclass
class PreparedRow:
    """A row ready to simulate."""

    row_id: str
    family: str
    metric: str
    measured: float
    workload: Workload
    strategy: Strategies
    num_devices: int
    flops_convention: str


@dataclass
class Unsimulable:
    row_id: str
    family: str
    reason: str


def family_of(row_id: str) -> str:
    """Source family: the id without its last dash-separated part (NAR21-03 → NAR21, VTRAIN-M-002 → VTRAIN-M)."""
    return row_id.rsplit("-", 1)[0] if "-" in row_id else row_id


def _int(row: dict, key: str, default: int | None = None) -> int | None:
    text = (row.get(key) or "").strip()
    if not text:
        return default
    return int(float(text))


def _cluster_overrides(source: str, devices_per_node: int) -> dict[str, float]:
    overrides: dict[str, float] = {}
    inter = re.search(r"(\d+(?:\.\d+)?)\s*Gb/s inter-node per node", source)
    if inter:
        overrides["inter_node_gbps"] = float(inter.group(1)) / 8.0 / devices_per_node
    return overrides


def row_cluster(row: dict) -> ClusterConfig:
    hardware = row["hardware"].strip()
    if hardware in _MEMORY_ONLY_HARDWARE and row["metric"].strip() != "peak_memory_gib":
        raise UserError(f"hardware {hardware}: no published peak FLOP/s, so only its memory rows are simulated")
    devices_per_node = _int(row, "devices_per_node")
    if hardware in _PRESET_OF_HARDWARE:
        base = load_cluster_config(_PRESET_OF_HARDWARE[hardware]).model_dump()
    elif hardware in _EXTRA_HARDWARE or hardware in _MEMORY_ONLY_HARDWARE:
        base = dict(name=hardware, device=hardware, **{**_EXTRA_HARDWARE, **_MEMORY_ONLY_HARDWARE}[hardware])
    else:
        raise UserError(f"hardware {hardware!r} is not in the hardware table")
    if devices_per_node:
        base["devices_per_node"] = devices_per_node
    base.update(_cluster_overrides(row.get("source", ""), base["devices_per_node"]))
    return ClusterConfig.model_validate(base)


def row_model(row: dict) -> ModelConfig:
    layers = _int(row, "layers")
    hidden = _int(row, "hidden")
    heads = _int(row, "heads")
    if row["attention"] == "mla":
        attention = MLAConfig(
            num_heads=heads,
            q_lora_rank=_int(row, "q_lora_rank", 0),
            kv_lora_rank=_int(row, "kv_lora_rank"),
            qk_nope_head_dim=_int(row, "qk_nope_dim"),
            qk_rope_head_dim=_int(row, "qk_rope_dim"),
            v_head_dim=_int(row, "v_head_dim"),
        )
    else:
        head_dim = _int(row, "head_dim") or hidden // heads
        attention = GQAConfig(num_heads=heads, num_kv_heads=_int(row, "kv_heads", heads), head_dim=head_dim)
    moe = None
    num_dense = layers
    if _int(row, "num_experts"):
        moe = MoEConfig(
            num_experts=_int(row, "num_experts"),
            expert_ffn_hidden=_int(row, "moe_ffn_hidden"),
            num_shared_experts=_int(row, "shared_experts", 0),
            router=RouterConfig(top_k=_int(row, "topk")),
        )
        num_dense = _int(row, "dense_layers", 0)
    source = row.get("source", "")
    mtp = 1 if ("MTP" in source and "w/o MTP" not in source) else 0
    return ModelConfig(
        name=row.get("model") or row["id"],
        vocab_size=_int(row, "vocab"),
        hidden_size=hidden,
        num_layers=layers,
        num_dense_layers=num_dense if moe is not None else 0,
        dense_ffn_hidden=_int(row, "ffn_hidden", 0),
        ffn_act=row["ffn_act"],
        attention=attention,
        moe=moe,
        num_mtp_layers=mtp,
    )


def prepare_row(row: dict) -> PreparedRow | Unsimulable:
    """Turn one CSV row into simulator inputs, or say why it cannot be simulated."""
    row = with_launch_facts(row)
    row_id = row["id"]
    family = family_of(row_id)
    problem = _unsimulable_reason(row)
    if problem is not None:
        return Unsimulable(row_id, family, problem)
    try:
        cluster = row_cluster(row)
        model = row_model(row)
    except ValidationError as exc:  # pydantic's own text is several lines, the first naming no field
        return Unsimulable(row_id, family, describe_validation_error("the row's model or cluster", exc))
    except (UserError, ValueError, TypeError) as exc:
        return Unsimulable(row_id, family, str(exc).splitlines()[0])
    strategy = row_strategy(row)
    workload = row_workload(row, model, cluster)
    if not (row.get("recompute") or "").strip():
        # A stack that picks its recomputation by memory saved per second lost (Pangu's Selective R/S)
        # recomputes only what the memory needs, not the selective set in every layer.
        adaptive = bool(re.search(r"Selective R/S", row.get("source", "")))
        strategy = _lightest_recompute_that_fits(workload, strategy, adaptive)
    return PreparedRow(row_id, family, row["metric"].strip(), float(row["value"]), workload, strategy,
                       _int(row, "num_devices"), (row.get("flops_convention") or "").strip())


def _unsimulable_reason(row: dict) -> str | None:
    """Why the row lacks what a prediction needs, before its model and cluster are read (None: it has it)."""
    metric = row["metric"].strip()
    if metric not in METRICS:
        return f"metric {metric!r} is not one of {', '.join(METRICS)}"
    needed = ("num_devices", "seq_len", "global_batch_seqs", "tp", "pp", "vocab", "layers", "hidden", "heads",
              "attention", "ffn_act")
    missing = [k for k in needed if not (row.get(k) or "").strip()]
    if missing:
        return f"no {', '.join(missing)} in the row"
    if metric in ("mfu", "tflops_per_device") and not row.get("flops_convention", "").strip():
        return "FLOP convention not stated"
    return None


def row_strategy(row: dict) -> Strategies:
    """The row's layout, its empty cells read as the module docstring says (recompute as stated: "none" when
    empty, which ``prepare_row`` then replaces with the least that fits)."""
    tp, pp = _int(row, "tp"), _int(row, "pp")
    cp = _int(row, "cp", 1)
    num_devices = _int(row, "num_devices")
    dp = _int(row, "dp") or num_devices // (tp * pp * cp)
    ep, etp = _int(row, "ep", 1), _int(row, "etp", 1)
    sp_stated = _int(row, "sp")
    sp = bool(sp_stated) if sp_stated is not None else tp > 1
    recompute = (row.get("recompute") or "").strip() or "none"
    zero = _int(row, "zero", 1)
    source = row.get("source", "")
    # Schedules that pair one micro-batch's forward with another's backward to hide the all-to-all.
    overlap = bool(re.search(r"DualPipe|fb-overlap|EP overlap", source))
    vpp, micro_batch = _pipeline_split(row, pp, dp, source)
    return Strategies(
        tp=np.array([tp]), sp=np.array([sp and tp > 1]), pp=np.array([pp]), vpp=np.array([vpp]),
        ep=np.array([ep]), etp=np.array([etp]), cp=np.array([cp]), dp=np.array([dp]), zero=np.array([zero]),
        micro_batch=np.array([micro_batch]),
        recompute=np.array([RECOMPUTE_NAMES.index(recompute)]), a2a=np.array([A2A_NAMES.index("flat")]),
        overlap=np.array([overlap]),
    )


def row_workload(row: dict, model: ModelConfig, cluster: ClusterConfig) -> Workload:
    """The row's workload: its batch and precision, and the mechanisms its ``source`` states (module docstring)."""
    precision = (row.get("precision") or "").strip() or "bf16"
    source = row.get("source", "")
    # Sliding-window attention named in the source ("alternates 128-token sliding-window and full
    # attention layers", GPT-OSS): half the layers attend to the window only.
    window = re.search(r"alternates (\d+)-token sliding-window and full attention layers", source)
    # Overlap the source states ("with DP/TP/PP comm overlap", "AsyncTP"; "no AsyncTP" states its absence).
    overlap_stated = {kind for stated in re.findall(r"\b([A-Z]{2}(?:/[A-Z]{2})*)[- ]comm overlap", source)
                      for kind in stated.split("/")}
    # AsyncTP (torch) and MC2 (MindSpeed's fused matmul + collective on Ascend) run the TP collectives under
    # the GEMMs
    if re.search(r"(?<!no )(AsyncTP|MC2)", source):
        overlap_stated.add("TP")
    # Megatron-Core's drop-and-pad dispatch: every expert gets exactly its capacity, the capacity factor
    # times the balanced load (tokens above it dropped, the rest padded), and the counts never reach the host.
    padded = re.search(r"experts padded to capacity \(capacity factor ([0-9.]+)\)", source)
    return Workload(
        model=model,
        cluster=cluster,
        seq_len=_int(row, "seq_len"),
        global_batch=_int(row, "global_batch_seqs"),
        precision=precision,
        imbalance=float(padded.group(1)) if padded else 1.0,
        moe_padded_to_capacity=bool(padded),
        # fp16 stacks reduce fp16 gradients; later ones accumulate and reduce them in fp32 unless the
        # source says otherwise (NeMo's performance recipes set grad_reduce_in_fp32 = False).
        grad_bytes=2.0 if precision == "fp16" or re.search(r"gradients reduced in BF16", source) else 4.0,
        # fp16 marks the pre-2022 stacks (Megatron 2021, Megatron-DeepSpeed, OPT) that materialised the
        # attention scores and reduced gradients after the backward; later stacks fuse attention (flash)
        # and overlap the data-parallel and tensor-parallel traffic with compute.
        flash_attention=precision != "fp16",
        # (and those that state it: torch DDP in the SC21 launch script, ``launch_facts``)
        overlap_grad_comm=precision != "fp16" or "DP" in overlap_stated,
        overlap_tp_comm=precision != "fp16",
        # Megatron's asynchronous TP all-reduce (Megatron-LM from late 2021, Megatron-DeepSpeed from 2022) and
        # Transformer Engine's Linear
        async_tp_input_grad=precision != "fp16" or "Megatron-DeepSpeed" in source,
        comm_overlap_stated=tuple(sorted(overlap_stated)),
        cp_gathers_mla_latent=False,  # the published stacks exchange up-projected keys and values
        bidirectional_pairing=bool(re.search(r"DualPipe", source)),
        # DualPipe (DeepSeek-V3 §3.2.1), MindSpeed's fb-overlap and the Adaptive Pipe built on it compute the
        # weight gradients apart and schedule them under the all-to-all.
        split_weight_grad=bool(re.search(r"DualPipe|fb-overlap|Adaptive Pipe|delay-wgrad", source)),
        attention_window=int(window.group(1)) if window else 0,
        window_layer_share=0.5 if window else 0.0,
        # GPT-3-style models (Megatron's and vTrain's GPT) learn absolute positions, MPT uses ALiBi; the
        # others rotate q and k.
        rotary_embeddings=not (re.match(r"GPT-(?!OSS)", row.get("model") or "") or "ALiBi" in source),
        # FP8 linears: Transformer Engine and DeepSeek keep the quantised inputs for backward, torchao's
        # Float8 linears the BF16 ones.
        fp8_stored_activations=precision == "fp8" and "torchao" not in source,
    )


def _pipeline_split(row: dict, pp: int, dp: int, source: str) -> tuple[int, int]:
    """Virtual stages per rank and micro-batch size, as the row states them (empty: 1 and 1), except for
    torchtitan pipeline runs that leave them unstated, which ran with torchtitan's defaults: two stages
    per rank for a multi-stage (interleaved) schedule, and as many micro-batches as pipeline stages in
    all, pp·stages per rank (torchtitan ``build_pipeline_schedule`` and ``generate_split_points``, late
    2024: "the default value will be the number of pipeline stages"). The local batch per data-parallel
    rank is split into those micro-batches."""
    vpp = _int(row, "vpp")
    micro_batch = _int(row, "micro_batch")
    if "torchtitan" in source and pp > 1:
        if vpp is None and re.search(r"[Ii]nterleaved", source):
            vpp = 2
        local_batch, num_micro = _int(row, "global_batch_seqs") // dp, pp * (vpp or 1)
        if micro_batch is None and local_batch % num_micro == 0:
            micro_batch = local_batch // num_micro
    return vpp or 1, micro_batch or 1


def _lightest_recompute_that_fits(workload: Workload, strategy: Strategies, adaptive: bool = False) -> Strategies:
    """A row that does not state its recomputation ran, so it fit in device memory: take the least
    recomputation whose predicted peak memory fits the device: none, selective, or selective with the
    smallest share of layers recomputed whole (in steps of 1/20; Megatron's --recompute-num-layers),
    full if nothing fits. ``adaptive``: the stack also recomputes the selective set on a share of the
    layers only (steps of 1/20 below selective). Memory does not depend on the fitted efficiencies, so the
    choice is made once, before any fit."""
    below = np.arange(1, 20) / 20.0 if adaptive else np.zeros(0)
    levels = np.concatenate([[0.0], below, [1.0], 1.0 + np.arange(1, 21) / 20.0])
    candidates = Strategies(**{f.name: np.repeat(getattr(strategy, f.name), levels.size)
                               for f in fields(Strategies)})
    candidates.recompute = levels
    memory = evaluate(workload, candidates, Efficiency()).memory.total
    fits = np.nonzero(memory <= workload.cluster.hbm_bytes)[0]
    chosen = int(fits[0]) if fits.size else levels.size - 1
    return candidates.take(np.array([chosen]))


def _number_problem(text: str) -> str | None:
    """Why ``text`` is not a finite number (None when it is)."""
    try:
        number = float(text)
    except ValueError:
        return "not a number"
    return None if math.isfinite(number) else "not a finite number"


def _cell_problem(column: str, text: str) -> str | None:
    """Why a whole-number or fixed-choice cell cannot be read, naming what it may hold (None when it can, or
    when it is empty: the source did not say)."""
    if not text:
        return None
    if column in CHOICE_COLUMNS:
        choices = CHOICE_COLUMNS[column]
        return None if text in choices else f"not one of {', '.join(choices)}"
    least, most = INTEGER_BOUNDS[column]
    allowed = f"a whole number of at least {least}" if most is None else f"a whole number from {least} to {most}"
    problem = _number_problem(text)
    if problem or float(text) != int(float(text)):
        return problem or f"not {allowed}"
    number = int(float(text))
    return None if least <= number and (most is None or number <= most) else f"not {allowed}"


def _value_problem(text: str) -> str | None:
    """Why the measurement cell is unusable: every row needs one, and a rate, a time or a memory is above 0."""
    if not text:
        return "value is empty"
    problem = _number_problem(text) or (None if float(text) > 0 else "not a positive number")
    return f"value is {text!r}, {problem}" if problem else None


def _layout_problem(row: dict) -> str | None:
    """Why the row's parallel degrees cannot lay out its devices (None when they can, or when a degree the
    check needs is not stated): tp·pp·cp must divide num_devices, and with dp stated multiply to it."""
    tp, pp, num_devices, dp = _int(row, "tp"), _int(row, "pp"), _int(row, "num_devices"), _int(row, "dp")
    cp = _int(row, "cp", 1)
    if tp is None or pp is None or num_devices is None:
        return None
    model_parallel = tp * pp * cp
    if dp is not None and model_parallel * dp != num_devices:
        return f"tp·pp·cp·dp = {tp}·{pp}·{cp}·{dp} = {model_parallel * dp} devices, not num_devices {num_devices}"
    if num_devices % model_parallel:
        return f"tp·pp·cp = {tp}·{pp}·{cp} = {model_parallel} does not divide num_devices {num_devices}"
    return None


def _check_row(row: dict, line: int, path: str | Path) -> None:
    """Refuse, by line, column and value, a cell the simulator could not read or a layout that does not fit
    the row's devices."""
    where = f"{path} line {line} (id {row.get('id') or '?'})"
    for column in (*INTEGER_COLUMNS, *CHOICE_COLUMNS):
        text = (row.get(column) or "").strip()
        problem = _cell_problem(column, text)
        if problem:
            raise UserError(f"{where}: {column} is {text!r}, {problem}; fix that cell or leave it empty if the "
                            "source does not say")
    problem = _value_problem((row.get("value") or "").strip())
    if problem:
        raise UserError(f"{where}: {problem}; give the measurement, a positive number in the unit its metric names")
    problem = _layout_problem(row)
    if problem:
        raise UserError(f"{where}: {problem}; fix the row's tp, pp, cp, dp or num_devices")


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a validation CSV (UTF-8), refused with one line when a column a prediction needs is
    missing, the file holds no rows, or a numeric cell is not a number."""
    p = Path(path)
    require_file(p, f"validation file {str(path)!r}", "give a CSV in the schema of shared/validation/README.md")
    text = read_text(p, f"validation file {path}", "save it as UTF-8", "give a CSV text file")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows: list[dict] = []
    try:
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path}: missing column(s) {', '.join(missing)}; add them as in "
                            "shared/validation/README.md")
        for row in reader:
            _check_row(row, reader.line_num, path)
            rows.append(row)
    except csv.Error as exc:
        raise UserError(f"{path} line {reader.line_num}: not valid CSV ({exc}); fix that line") from None
    if not rows:
        raise UserError(f"{path} holds a header but no rows; add one row per measurement")
    return rows


def metric_of(row: PreparedRow, costs: StepCosts, i: int) -> float:
    """The row's metric (``row.metric``, one of ``METRICS``) from entry ``i`` of the predicted costs."""
    w = row.workload
    step = float(costs.step_time_s[i])
    if row.metric == "step_time_s":
        return step
    if row.metric == "peak_memory_gib":
        return float(costs.memory.total[i]) / 2**30
    tokens = w.global_batch * w.seq_len
    if row.metric == "tokens_per_s_per_device":
        return tokens / step / row.num_devices
    model_flops = training_flops_per_token(w.model, w.seq_len) * tokens
    flops = model_flops * (float(costs.hardware_flops_factor[i]) if row.flops_convention == "hardware" else 1.0)
    if row.metric == "tflops_per_device":
        return flops / step / row.num_devices / 1e12
    assert row.metric == "mfu", row.metric
    return flops / step / row.num_devices / w.cluster.peak_flops("bf16")


def predict(row: PreparedRow, calibration: Calibration) -> tuple[float, StepCosts]:
    """The row's metric as the simulator predicts it, and the costs it comes from."""
    costs = evaluate(row.workload, row.strategy, calibration.for_device(row.workload.cluster.device))
    return metric_of(row, costs, 0), costs


def abs_pct_errors(predicted, measured) -> np.ndarray:
    predicted, measured = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(predicted - measured) / np.abs(measured) * 100.0


def summarize(errors: list[float]) -> dict[str, float]:
    if not errors:
        return {"median_abs_pct_error": math.nan, "p90_abs_pct_error": math.nan, "n": 0}
    arr = np.asarray(errors, dtype=float)
    return {
        "median_abs_pct_error": float(np.median(arr)),
        "p90_abs_pct_error": float(np.percentile(arr, 90)),
        "n": int(arr.size),
    }


def require_simulable(prepared: list[PreparedRow], skipped: list[Unsimulable], source: str | Path) -> None:
    """Refuse in one line a file none of whose rows can be simulated, with the first rows' reasons: a score
    over no rows is no score."""
    if prepared:
        return
    shown = "; ".join(f"{s.row_id}: {s.reason}" for s in skipped[:3])
    more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    raise UserError(f"{source}: no row can be simulated ({shown}{more}); give each row what "
                    "shared/validation/README.md says a prediction needs")


def prepare_all(rows: list[dict]) -> tuple[list[PreparedRow], list[Unsimulable]]:
    prepared: list[PreparedRow] = []
    skipped: list[Unsimulable] = []
    for row in rows:
        item = prepare_row(row)
        (prepared if isinstance(item, PreparedRow) else skipped).append(item)
    return prepared, skipped
