"""Efficiency parameters of the cost model: few, global per operation class, optionally per hardware.

The simulator predicts time as work / (hardware peak × efficiency). The efficiencies are the model's
only free parameters; they are fitted once on published runs (``moetrain validate --fit``) or
measured on the local device (``moetrain profile``), never per row. A parameter may be overridden per
hardware *architecture* (ampere, hopper, ...) when runs of that architecture are available; an
architecture with no data falls back to the global value.

File format (YAML or JSON)::

    global: {gemm_max: 0.7, ...}
    per_arch: {ampere: {gemm_max: 0.75}}
    fitted_on: ...        # free text: what produced the file
    accuracy: {mode: leave-one-family-out, median_abs_pct_error: 6.2, ...}
    held_out_fits: {NAR21: {global: {...}, per_arch: {...}}, ...}   # one fit per family left out
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

import yaml

from moetrain.errors import UserError
from moetrain.textfile import read_text, require_file

# Accelerator id (validation schema's ``hardware`` column, ClusterConfig.device) → architecture.
_ARCH_OF_DEVICE: dict[str, str] = {
    "a100-sxm-80gb": "ampere",
    "a100-sxm-40gb": "ampere",
    "a800-sxm-80gb": "ampere",
    "h100-sxm-80gb": "hopper",
    "h100-sxm-96gb": "hopper",
    "h800-sxm-80gb": "hopper",
    "h200-sxm-141gb": "hopper",
    "b200": "blackwell",
    "gb200": "blackwell",
    "ascend-910b": "ascend",
    "cpu": "cpu",
}

# Parameters that may take a per-architecture value; the others are global by construction. Only the GEMM
# efficiency is fitted per architecture. Fused attention and the element-wise memory efficiency are fitted
# once (relative to each part's peak): per architecture they are identified by one or two source families
# only, and on Blackwell the fit traded them against the GEMM efficiency (gemm_max at its bound, attention
# or memory at 14-15 %) for at most 0.7 points of cross-validated 90th percentile
# (benchmarks/notes/planner.md, "Fit variants"; benchmarks/planner_fit_variants.py).
PER_ARCH_PARAMS: tuple[str, ...] = ("gemm_max",)

# Parameters the fit on published runs leaves at their default (a profile or a user's file may still set
# them). ``step_overhead_ms``: the published runs do not identify a fixed per-step cost apart from the
# GEMM efficiency; left free, leave-one-family-out fits traded 110-160 ms per step against it on the
# rows with sub-second steps and mispredicted the held-out families by 20-25 % (benchmarks/notes/planner.md,
# "Free parameters"). The
# optimizer update, the per-step cost the model does price, is memory traffic
# (``costmodel.OPTIMIZER_BYTES_PER_PARAM``). The host issue times stay zero for the published runs (their
# kernels are large, so the device is the bottleneck); ``moetrain profile`` measures them where they matter.
# So it does the masked attention kernels' slowdowns: no published run states a document mask.
NOT_FITTED: tuple[str, ...] = ("step_overhead_ms", "host_layer_us", "host_optimizer_ms", "host_probe_tokens",
                               "host_wide_layer_us", "host_wide_batch", "host_wide_seq",
                               "attention_block_slowdown", "attention_dense_slowdown")



def arch_of(device: str) -> str:
    """Architecture class of an accelerator id; unknown devices form their own class."""
    return _ARCH_OF_DEVICE.get(device, device)


# The prior of ``Efficiency.moe_overhead_us``: the 30-50 kernels a dropless MoE layer issues after its
# token-count sync, at the host time per kernel of an eager PyTorch stack that the host bounds. This
# project's runtime took 349.3 ms per tiny-pangu step on an H100 host with the device 7 % busy
# (benchmarks/results/planner_step_check_gpu.json) for 15,274 kernels per step
# (benchmarks/results/gpu_step_profile_tiny.json): 22.9 µs each. The prior is the geometric mean of 30
# and 50 such kernels, 0.89 ms (0.69-1.14 ms); it was 0.5 ms, from a guessed 10-20 µs per kernel.
MOE_PASS_HOST_KERNELS = (30, 50)
HOST_US_PER_KERNEL_EAGER = 349.2867 / 15274 * 1e3
MOE_PASS_PRIOR_US = (MOE_PASS_HOST_KERNELS[0] * MOE_PASS_HOST_KERNELS[1]) ** 0.5 * HOST_US_PER_KERNEL_EAGER


@dataclass(frozen=True)
class MeasuredPrior:
    """A fitted parameter's value as a kernel probe measured it on the hardware, and how far from it a fit
    on published runs may sit before the pull back costs as much as a row that misses by the fit's loss
    scale (``fit.LOSS_SCALE``, 10 %)."""

    value: float
    spread: float
    """Relative deviation from ``value`` that the fit weighs like one row 10 % off."""


# Hopper's large-GEMM rate as ``moetrain profile`` fitted it on each Hopper device this project has run on
# (``per_arch.hopper.gemm_max`` in the calibration each check recorded): an H100 at 7d18c21
# (benchmarks/results/planner_step_check_gpu.json), an H100 at a434bcb
# (planner_step_check_gpu_pangu-shaped-small.json) and an H200 at 7b5f6aa
# (planner_step_check_h200_pangu-shaped-small.json). ``gemm_max`` is the one fitted parameter such a probe
# measures as the model defines it (a large GEMM's share of the peak); the fitted attention and element-wise
# efficiencies also carry costs the probes do not run (benchmarks/notes/planner.md, "Free parameters").
HOPPER_GEMM_MAX_PROFILED = (0.7217561951601656, 0.7180529310674478, 0.6854948827405707)
# The spread: the probes' large GEMMs reach 0.69-0.79 of the peak across shapes and the two devices, and a
# fitted rate stands for every GEMM of a training step.
MEASURED_PRIORS: dict[tuple[str, str], MeasuredPrior] = {
    ("hopper", "gemm_max"): MeasuredPrior(
        value=(HOPPER_GEMM_MAX_PROFILED[0] * HOPPER_GEMM_MAX_PROFILED[1] * HOPPER_GEMM_MAX_PROFILED[2]) ** (1 / 3),
        spread=0.10),
}


@dataclass(frozen=True)
class Efficiency:
    """Efficiency factors for one device (global values with that device's overrides applied)."""

    gemm_max: float = 0.75
    """Fraction of the dense peak a large GEMM reaches."""
    gemm_overhead_us: float = 8.0
    """Fixed cost per kernel call (launch, tail wave; GEMMs and element-wise kernels alike): why a small
    GEMM is slower per FLOP and why small models are launch-bound."""
    moe_overhead_us: float = MOE_PASS_PRIOR_US
    """Fixed cost per MoE layer pass (router top-k, token-count sync, permute/unpermute kernel chains).
    Prior (``MOE_PASS_PRIOR_US``): a dropless MoE layer synchronises the host on the per-expert token
    counts (they size the all-to-all splits and the grouped GEMM), after which the device idles while the
    host issues the layer's remaining 30-50 kernels."""
    attention: float = 0.55
    """Fraction of the dense peak fused (flash) attention reaches on QKᵀ and PV."""
    memory: float = 0.7
    """Fraction of HBM bandwidth that element-wise kernels (norms, activations, permutes) reach."""
    fp8_gain: float = 1.5
    """Speed-up of an FP8 GEMM over the same BF16 GEMM (≤ the peak ratio 2), its operands already quantised:
    the casts are priced apart, as memory traffic (``layer_costs.FP8_CAST_BYTES_PER_ELEMENT``)."""
    bus_intra: float = 0.8
    """Fraction of the in-node link bandwidth a collective reaches (NCCL/HCCL bus efficiency)."""
    bus_inter: float = 0.8
    """Fraction of the per-device network bandwidth a collective reaches."""
    grad_overlap: float = 0.5
    """Fraction of the data-parallel gradient/parameter traffic hidden under backward compute."""
    tp_overlap: float = 0.0
    """Fraction of tensor-parallel collectives hidden under GEMMs (TE comm overlap, AsyncTP)."""
    step_overhead_ms: float = 0.0
    """Fixed host/launch cost per optimizer step that no other term captures."""
    host_layer_us: float = 0.0
    """Host time to issue one decoder layer's forward and backward in an eager stack (Python, dispatcher,
    kernel launches; the embedding, head and loss spread over the layers). A layer pass takes at least this
    long whatever its kernels cost: small models on a GPU are host-bound. 0: never host-bound (the
    published runs' kernels are large). ``moetrain profile`` measures it on a GPU."""
    host_optimizer_ms: float = 0.0
    """Host time to issue one optimizer step (gradient norm, clipping, AdamW); the update takes at least
    this long. Measured with ``host_layer_us``."""
    host_probe_tokens: float = 16.0
    """Tokens of the micro-batch at which ``host_layer_us`` was measured. Where the host is the device (a
    CPU: ``ClusterConfig.host_is_device``) the host time adds to the device's instead of bounding it from
    below, and the device work the cost model prices at these tokens is already inside the measurement, so
    it is not counted twice (``costmodel._pass_times``)."""
    host_wide_layer_us: float = 0.0
    """Where the host is the device: the same measurement as ``host_layer_us`` on a wide micro-batch
    (``host_wide_batch`` sequences of ``host_wide_seq`` tokens, the size CPU runs train at). What it has
    beyond the priced device work grows with the tokens (kernels the model prices at a large-GEMM rate run
    slower at a small model's skinny shapes; a fallback attention), so the two measurements give that excess
    as a line in the tokens of a pass (``costmodel._host_excess``). 0: not measured (a constant excess)."""
    host_wide_batch: float = 4.0
    host_wide_seq: float = 128.0
    attention_block_slowdown: float = 1.0
    """FlexAttention's time per computed tile, forward and backward, over the fused causal kernel's at the
    same shape: what a micro-batch under the document mask's tiles pays per tile it computes
    (``documents.core_time_factor``). ``moetrain profile`` measures it on a GPU at the model's head dims;
    1.0: not measured (priced as the causal kernel)."""
    attention_dense_slowdown: float = 1.0
    """The same for the fused kernel handed a dense boolean mask (it computes the whole square)."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Calibration:
    """Global efficiencies plus per-architecture overrides; ``for_device`` resolves one device."""

    global_params: Efficiency
    per_arch: dict[str, dict[str, float]]
    fitted_on: str = ""
    accuracy: dict[str, float | int | str] = field(default_factory=dict)
    """How well the file predicts published runs, as ``moetrain validate --fit`` measured it: ``mode``
    (leave-one-family-out with --cv, else in-sample), ``rows``, ``median_abs_pct_error``,
    ``p90_abs_pct_error`` and ``file``. Empty for a profile of the local device."""
    held_out_fits: dict[str, Calibration] = field(default_factory=dict)
    """The cross-validation's fits (``moetrain validate --fit --cv``), by the family each leaves out: the
    parameters as they would be without that source. ``moetrain plan`` re-ranks its layouts under each,
    so a choice that hangs on one source's efficiencies shows. Empty without --cv and for a profile."""

    def for_device(self, device: str) -> Efficiency:
        overrides = self.per_arch.get(arch_of(device), {})
        return replace(self.global_params, **overrides) if overrides else self.global_params

    def held_out_for_device(self, device: str) -> dict[str, Efficiency]:
        """``for_device`` of each held-out fit, by the family it leaves out (empty without them)."""
        return {family: fit.for_device(device) for family, fit in self.held_out_fits.items()}

    @property
    def free_parameter_count(self) -> int:
        """Global values plus per-architecture values; a global value that is the mean of per-architecture
        ones (what ``fit`` does) is not free, nor is a parameter the fit leaves at its default, nor the
        ``cpu`` architecture's values, which ``moetrain profile`` measured (``with_shipped_cpu``): the
        published runs hold no CPU."""
        fitted_arches = {arch: v for arch, v in self.per_arch.items() if arch != "cpu"}
        derived = {p for overrides in fitted_arches.values() for p in overrides}
        fitted = [f.name for f in fields(Efficiency) if f.name not in NOT_FITTED]
        return len(fitted) - len(derived & set(fitted)) + sum(len(v) for v in fitted_arches.values())

    def to_dict(self) -> dict:
        data = {
            "fitted_on": self.fitted_on,
            "free_parameters": self.free_parameter_count,
            "global": self.global_params.as_dict(),
            "per_arch": {k: dict(v) for k, v in sorted(self.per_arch.items())},
        }
        if self.accuracy:
            data["accuracy"] = dict(self.accuracy)
        if self.held_out_fits:
            # Only the fitted parameters: the others are the defaults in every fit.
            data["held_out_fits"] = {
                family: {"global": {k: v for k, v in fit.global_params.as_dict().items() if k not in NOT_FITTED},
                         "per_arch": {k: dict(v) for k, v in sorted(fit.per_arch.items())}}
                for family, fit in sorted(self.held_out_fits.items())}
        return data

    def save(self, path: str | Path) -> None:
        path = Path(path)
        data = self.to_dict()
        path.write_text(json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))


def accuracy_line(accuracy: dict) -> str | None:
    """One line on a calibration's recorded error on published runs (``Calibration.accuracy``), for
    ``simulate`` and ``plan``; None when the record is missing or incomplete."""
    a = accuracy
    if not {"mode", "rows", "median_abs_pct_error", "p90_abs_pct_error"} <= set(a):
        return None
    runs = f"the {a['rows']} runs of {a['file']}" if a.get("file") else f"{a['rows']} published runs"
    return (f"calibration error on {runs} ({a['mode']}): median {float(a['median_abs_pct_error']):.1f} %, "
            f"90th percentile {float(a['p90_abs_pct_error']):.1f} %")


# Efficiencies the cost model divides by (shares of a peak, a speed-up): at 0 every step would take forever.
_RATES = ("gemm_max", "attention", "memory", "fp8_gain", "bus_intra", "bus_inter")
# What ``Calibration.to_dict`` writes at the top of a file: anything else is some other file.
_FILE_KEYS = ("fitted_on", "free_parameters", "global", "per_arch", "accuracy", "held_out_fits")
_WRITE_ONE = "write one with `moetrain profile --out FILE` or `moetrain validate --fit FILE`"


def _parameters(values: object, where: str, source: str) -> dict[str, float]:
    """``values`` (the ``where`` section of ``source``) as known parameters with finite values, none below 0 and
    the rates above it; anything else is one ``UserError`` naming the parameter."""
    if not isinstance(values, dict):
        raise UserError(f"{source}: {where} must map parameter names to numbers, e.g. {{gemm_max: 0.7}}")
    known = {f.name for f in fields(Efficiency)}
    unknown = set(map(str, values)) - known
    if unknown:
        raise UserError(f"{source}: unknown calibration parameter(s) {sorted(unknown)}; known: {sorted(known)}")
    parameters: dict[str, float] = {}
    for name, value in values.items():
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        if not math.isfinite(number) or number < 0 or (name in _RATES and number == 0):
            least = "above 0" if name in _RATES else "0 or more"
            raise UserError(f"{source}: {where}.{name} is {value!r}; give a finite number {least}")
        parameters[name] = number
    return parameters


def _check_calibration_file(data: dict, source: str) -> None:
    """Refuse a mapping that is not a calibration file (a plan, a model or a cluster YAML given by mistake):
    keys a calibration file does not have, or neither of its parameter sections."""
    unknown = [str(k) for k in data if k not in _FILE_KEYS]
    if unknown:
        shown = ", ".join(unknown[:4]) + (", …" if len(unknown) > 4 else "")
        raise UserError(f"{source}: not a calibration file (it has {shown}; a calibration file has global and "
                        f"per_arch sections); {_WRITE_ONE}")
    if "global" not in data and "per_arch" not in data:
        raise UserError(f"{source}: not a calibration file (no global or per_arch section); {_WRITE_ONE}")


def calibration_from_dict(data: dict, source: str) -> Calibration:
    glob = _parameters(data.get("global") or {}, "global", source)
    arches = data.get("per_arch") or {}
    if not isinstance(arches, dict):
        raise UserError(f"{source}: per_arch must map architectures to parameters, e.g. {{hopper: {{gemm_max: 0.7}}}}")
    per_arch = {str(k): _parameters(v, f"per_arch.{k}", source) for k, v in arches.items()}
    accuracy = data.get("accuracy") or {}
    if not isinstance(accuracy, dict):
        raise UserError(f"{source}: 'accuracy' must be a mapping (mode, rows, median_abs_pct_error, "
                        "p90_abs_pct_error), as `moetrain validate --fit` writes it")
    held_out = data.get("held_out_fits") or {}
    if not isinstance(held_out, dict) or not all(isinstance(v, dict) for v in held_out.values()):
        raise UserError(f"{source}: 'held_out_fits' must map each left-out family to a mapping with 'global' and "
                        "'per_arch', as `moetrain validate --fit --cv` writes it")
    return Calibration(
        Efficiency(**glob), per_arch, str(data.get("fitted_on", "")),
        {str(k): v for k, v in accuracy.items()},
        {str(family): calibration_from_dict(fit, f"{source} (held-out fit {family})")
         for family, fit in held_out.items()},
    )


def load_calibration(path: str | Path | None = None) -> Calibration:
    """The shipped default (fitted on shared/validation/calibration.csv, with the shipped CPU profile as
    the ``cpu`` architecture) or a user's file."""
    if path is None:
        text = (resources.files("moetrain.planner") / "calibration_default.yaml").read_text()
        return with_shipped_cpu(calibration_from_dict(yaml.safe_load(text) or {}, "calibration_default.yaml"))
    data = read_profile_file(path, "calibration", "--out FILE", "'global' and 'per_arch' sections")
    _check_calibration_file(data, str(path))
    return calibration_from_dict(data, str(path))


def read_profile_file(path: str | Path, kind: str, flag: str, sections: str) -> dict:
    """The mapping in a file ``moetrain profile {flag}`` wrote (YAML, or JSON by its suffix); a missing,
    malformed or non-mapping file is one ``UserError`` naming the ``kind`` of file and its ``sections``."""
    p = Path(path)
    require_file(p, f"{kind} file {str(path)!r}", f"write one with `moetrain profile {flag}`")
    try:
        text = read_text(p, f"{kind} file {path}", f"save it as UTF-8 or write it again with `moetrain profile {flag}`")
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: not a valid {kind} file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping with {sections}")
    return data


def with_shipped_cpu(calibration: Calibration) -> Calibration:
    """``calibration`` with the shipped CPU profile (``calibration_cpu.yaml``) as its ``cpu`` architecture,
    in it and in each held-out fit: the published runs hold no CPU, so the fit on them says nothing of
    one, and leaving a source out changes nothing there."""
    text = (resources.files("moetrain.planner") / "calibration_cpu.yaml").read_text()
    cpu = calibration_from_dict(yaml.safe_load(text) or {}, "calibration_cpu.yaml").per_arch["cpu"]

    def add(fit: Calibration) -> Calibration:
        return replace(fit, per_arch={**fit.per_arch, "cpu": dict(cpu)})

    return replace(add(calibration), held_out_fits={k: add(v) for k, v in calibration.held_out_fits.items()})


def default_calibration() -> Calibration:
    """Physics priors only (no fit), the measured ones per architecture (``MEASURED_PRIORS``): used when the
    shipped file is missing and as the fit's start and prior."""
    per_arch: dict[str, dict[str, float]] = {}
    for (arch, param), prior in MEASURED_PRIORS.items():
        per_arch.setdefault(arch, {})[param] = prior.value
    return Calibration(Efficiency(), per_arch, "priors")
