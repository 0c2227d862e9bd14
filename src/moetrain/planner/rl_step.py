"""One RL step (``moetrain simulate --rl``): generation, reward, extra log-prob forwards, training and the
weight transfer, priced for the two placements of ``moetrain rl``, so a user can choose before booking.

Colocated (RL Fusion, docs/rl_fusion.md): every device trains and generates in turn. A step is the sum

    offload → reshard → generate → (free) → restore, then reward, log-prob forwards, train

- offload / restore: optimizer state (fp32 master, Adam m and v: 12 B per local parameter) and fp32 grads
  (4 B) to host memory and back over the host link (only with ``offload``);
- reshard: each generating device receives the weights it lacks (bf16; fp32 for fp32 runs) from the
  training shards, bucket after bucket in the sync's one global order (``_colocated_transfers``): each
  lacked byte crosses the link once, one latency per bucket (``RLLayout.sync_bucket_bytes``), and with
  measured ``SyncRates`` the sync's host work (a copy and a CRC-32 of every bucket by its owner and by its
  receivers, one bucket after the other, the boxes a device already holds included) and its closing
  all-reduce;
- free: the KV cache goes back to the allocator (no data moves: priced at zero).

With staleness k ≥ 1 (``moetrain.rl.colocated``) the next batch generates during the update, on the same
devices, one version old: step = reshard + gather + reward + forwards + overlap(generate, train), where
the overlap (``colocated_overlap``) fills only the device time generation leaves idle (on a CPU whose
cores the two threads share: processor sharing). No offload, one whole model per device.
With the ranks' CPU-seconds per step probed on one CPU (``RLLayout.rank_cpu``), a colocated step at either
kind of k is those works shared over the CPU's cores instead (``rl_cores.colocated_cpu_step``): N ranks on
C < N cores do not each compute as fast as a device of their own, which is what the phases assume.

Disaggregated (StaleSync, docs/rl_stalesync.md): ``rollout_devices`` generate and score, the rest train
and push the new weights (bf16, or the precision's width) to the rollout replicas after each update. With
staleness k = 0 the two sides alternate: step = generate + reward + forwards + train + push. With k ≥ 1 the
rollout side generates batch s + k while the trainer trains step s, so in the steady state

    step = max(generate + reward, forwards + train) + push

(on one CPU whose cores both sides share, the overlap is priced by processor sharing instead:
``overlapped_time``, over every process of both sides: the R rollout replicas and the trainer group's
ranks).

With R rollout replicas beside a trainer group of T ranks (``moetrain rl --nproc N --rollout-replicas R``)
each replica generates its share of every batch (samples / R rows), and each bucket of the push is packed
once by the trainer rank that owns it and sent to every replica at once: a trainer rank packs 1 / T of the
weights, sends R / T of them, and every replica receives and checks the whole model.

The push stays on the critical path: the runtime's weight sync is a collective that both sides join
between two batches (``moetrain.distributed.weight_sync``); a double-buffered receiver would hide it.
The steady state is the same for every k ≥ 1: a larger k only absorbs the jitter of variable-length
generations and of the machine, which this steady-state price does not see.

Training is the planner's own step for the training layout (``moetrain.planner.simulate``), on the step's
samples as sequences of prompt + response tokens; generation is ``moetrain.planner.generation``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Literal

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.costs.params import count_params
from moetrain.errors import UserError
from moetrain.planner.calibration import Calibration, Efficiency
from moetrain.planner.comm import allgather_time, allreduce_time, p2p_time, ranks_per_node
from moetrain.planner.compute import memory_time
from moetrain.planner.generation import GenerationTimes, HostCosts, Replica, forward_time, generation_time
from moetrain.planner.rl_cores import RankCPU, RoleCPU, colocated_cpu_step, shared_cpu_step
from moetrain.planner.simulate import simulate_layout
from moetrain.planner.workload import Workload, runtime_workload

# Optimizer state and gradients offloaded per local parameter: fp32 master, Adam m and v, fp32 grad.
OFFLOAD_BYTES_PER_PARAM = 16.0

Placement = Literal["colocated", "disaggregated"]


@dataclass(frozen=True)
class RLWorkload:
    """What one RL step does, whatever the placement."""

    model: ModelConfig
    cluster: ClusterConfig
    prompts: int
    """Prompts per step."""
    samples_per_prompt: int
    """GRPO's group size."""
    prompt_len: int
    response_len: int
    """Tokens generated per sample (the decode steps of a batch: give its longest answers)."""
    precision: str = "bf16"
    logprob_forwards: int = 0
    """Forwards over the step's samples besides training's own: a reference model (KL), a proximal
    policy (decoupled loss), routing diagnostics."""
    reward_s: float = 0.0
    """Seconds to score the step's samples (a reward model or a verifier), on the generating side."""
    train_seq_len: int | None = None
    """Tokens per trained sequence when the trainer pads to a fixed length; None: prompt + response."""
    completion_len: float | None = None
    """Mean tokens per completion: the tokens the trainer's loss and the log-prob forwards score, where
    they run the output head (``rl.grpo.PolicyObjective``); None: ``response_len`` (no sample stops early)."""
    decode_running_share: float = 1.0
    """Mean share of a batch's rows still running in a decode step (rows that stop early leave the batch;
    counted by generating the workload's batches: the engine's ``rows_computed`` over decode steps × rows);
    1: every row runs to ``response_len``."""
    logprob_on_generation: bool = False
    """Colocated: the log-prob forwards run on every generation replica's model, each over all of the
    step's samples (moetrain's RL Fusion: its replay diagnostics forward runs on the generation model,
    whole on every rank, in chunks of the training micro-batch); False: in the training layout, a third of
    training's forward + backward."""

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.train_seq_len or self.prompt_len + self.response_len

    @property
    def samples_workload(self) -> Workload:
        """The step's samples as the planner's workload (model, cluster, trained length, batch, precision)."""
        return Workload(self.model, self.cluster, self.seq_len, self.samples, self.precision)

    @property
    def head_share(self) -> float:
        """Share of a trained sequence's positions at which the head runs: its completion tokens."""
        return min((self.completion_len or self.response_len) / self.seq_len, 1.0)

    @property
    def generated_tokens(self) -> int:
        return self.samples * self.response_len


@dataclass(frozen=True)
class RLLayout:
    """Devices and layouts of one placement."""

    placement: Placement
    devices: int
    """All devices of the job."""
    train: ParallelConfig
    """The training layout (its dp: what the training devices leave)."""
    gen_devices_per_replica: int = 1
    """Devices holding one generation replica (its experts split over them)."""
    rollout_devices: int = 0
    """Disaggregated: devices that generate (the other ``devices − rollout_devices`` train)."""
    staleness: int = 0
    offload: bool = False
    """Colocated: optimizer state and grads to host during generation."""
    host_link_gbps: float | None = None
    """Host link per device, one way (GB/s; PCIe); None: the device memory's bandwidth (a CPU)."""
    shared_cores: float | None = None
    """On one CPU, where the two overlapped sides (disaggregated: the rollout and training processes;
    colocated with k ≥ 1: a process's generating and training threads) share this many cores' worth of
    compute (measured; SMT siblings give less than two); None: separate devices, or one accelerator."""
    sync_bucket_bytes: float | None = None
    """The weight sync's bucket size: each bucket a device receives is one message, one latency (None:
    the ring's latencies only)."""
    role_cpu: RoleCPU | None = None
    """Disaggregated on one CPU: every process's CPU-seconds per step measured alone
    (``moetrain.rl.rates.role_cpu``); with it a step at k ≥ 1 is those works shared over ``shared_cores``
    cores (``rl_cores.shared_cpu_step``) instead of the priced phases."""
    rank_cpu: RankCPU | None = None
    """Colocated on one CPU: every rank's CPU-seconds per step probed on the job (``moetrain.rl.rates.rank_cpu``);
    with it the step is those works shared over ``shared_cores`` cores (``rl_cores.colocated_cpu_step``)
    instead of the priced phases, which price each rank as if it had a device of its own."""

    @property
    def train_devices(self) -> int:
        return self.devices - self.rollout_devices if self.placement == "disaggregated" else self.devices

    @property
    def generating_devices(self) -> int:
        return self.rollout_devices if self.placement == "disaggregated" else self.devices

    @property
    def replicas(self) -> int:
        return self.generating_devices // self.gen_devices_per_replica


@dataclass(frozen=True)
class SyncRates:
    """The weight sync's host work per byte (measured: ``moetrain profile --comm-ranks``). Every synced
    byte is packed into a bucket by its owner (one copy, one CRC-32) and written into the generation
    weights by its receiver (one copy, one CRC-32 recomputed from them: ``distributed.weight_sync``)."""

    copy_bytes_per_s: float
    crc_bytes_per_s: float
    host_bytes_per_s: float | None = None
    """Bytes one side packs (or writes) per second as the sync runs on the model itself, its per-box and
    per-bucket work included (``train.profiler.profile_weight_sync``); None: the copy and CRC-32 rates of
    one large buffer alone."""

    def seconds(self, num_bytes: float) -> float:
        """One copy and one CRC-32 of ``num_bytes`` (one side's work: a pack or a write)."""
        if self.host_bytes_per_s is not None:
            return num_bytes / self.host_bytes_per_s
        return num_bytes / self.copy_bytes_per_s + num_bytes / self.crc_bytes_per_s


@dataclass(frozen=True)
class RLPhases:
    """Seconds of each phase of one step (each on the devices that run it)."""

    generate_s: float
    prefill_s: float
    decode_s: float
    reward_s: float
    logprob_s: float
    train_s: float
    offload_s: float = 0.0
    reshard_s: float = 0.0
    restore_s: float = 0.0
    push_s: float = 0.0
    """Disaggregated: the whole weight push (with k ≥ 1 the trainer's step pays only its packing; the rest
    runs before the rollout side's next generation)."""
    gather_s: float = 0.0
    """Colocated, several replicas: every rank gathers the generated rows (token ids, log-probs, replay
    record) from the others."""


PHASES_MODEL = "phases"
"""The step is the priced phases (generation, training, the push; overlapped at k ≥ 1)."""
SHARED_CPU_MODEL = "processor sharing"
"""The step is the probed CPU-seconds per process shared over the cores (``RLLayout.role_cpu`` of a
disaggregated job, ``RLLayout.rank_cpu`` of a colocated one; ``rl_cores``)."""


@dataclass(frozen=True)
class RLStepPrediction:
    placement: Placement
    staleness: int
    devices: int
    train_devices: int
    generating_devices: int
    replicas: int
    phases: RLPhases
    step_s: float
    generated_tokens_per_s: float
    tokens_per_s: float
    """Prompt and generated tokens per second (what the trainer trains on)."""
    decode_memory_bound: bool
    train_fits_memory: bool
    step_model: str = PHASES_MODEL
    """What priced ``step_s``: ``PHASES_MODEL`` or ``SHARED_CPU_MODEL``."""


def _check(w: RLWorkload, layout: RLLayout) -> None:
    if layout.placement == "disaggregated" and not 0 < layout.rollout_devices < layout.devices:
        raise UserError(f"disaggregated needs rollout devices between 1 and {layout.devices - 1} "
                        f"(got {layout.rollout_devices}); set --rollout-devices")
    overlapped_colocated = layout.placement == "colocated" and layout.staleness > 0
    if overlapped_colocated and (layout.offload or layout.gen_devices_per_replica > 1):
        raise UserError("colocated with staleness k ≥ 1 generates beside the update on a whole model per device, "
                        "with both resident: drop --offload and use --gen-ep 1 (or staleness 0)")
    if layout.generating_devices % layout.gen_devices_per_replica:
        raise UserError(f"{layout.gen_devices_per_replica} devices per generation replica do not divide the "
                        f"{layout.generating_devices} generating devices; change --gen-ep")
    if layout.train.world_size != layout.train_devices:
        raise UserError(f"the training layout covers {layout.train.world_size} devices, not the "
                        f"{layout.train_devices} that train; change --tp/--pp/--ep or the device split")
    if w.samples % layout.replicas:
        raise UserError(f"{w.samples} samples per step do not split over {layout.replicas} generation replicas; "
                        "change --prompts, --group-size or --gen-ep")
    if layout.role_cpu is not None:
        _check_probe(layout, "disaggregated", "per process", role_cpu_mismatch(layout.role_cpu, layout))
    if layout.rank_cpu is not None:
        _check_probe(layout, "colocated", "per rank", rank_cpu_mismatch(layout.rank_cpu, layout))


def _check_probe(layout: RLLayout, placement: Placement, per: str, mismatch: str | None) -> None:
    """A probe's CPU-seconds (``per`` process or rank) price a job of its placement on a CPU of given cores,
    and of its processes (``mismatch``: why not, from ``role_cpu_mismatch`` / ``rank_cpu_mismatch``)."""
    if layout.placement != placement or layout.shared_cores is None:
        what = "role" if placement == "disaggregated" else "rank"
        raise UserError(f"measured CPU-seconds {per} price a {placement} job on one CPU: give the layout its "
                        f"shared cores and placement {placement}, or drop the {what} CPU")
    if mismatch is not None:
        raise UserError(mismatch)


def rank_cpu_mismatch(work: RankCPU, layout: RLLayout) -> str | None:
    """Why ``work``'s ranks are not the colocated ``layout``'s (None: they are): the probe measures one job's
    ranks (``moetrain.rl.rates.rank_cpu``), each generating on a whole model (gen-ep 1), at k = 0 (the phases
    take turns) or at k ≥ 1 (generation beside the update): it prices jobs of its ranks, gen-ep and kind."""
    probe = "probe this layout's job (`moetrain profile --rl-out FILE --rl-job rl.yaml`)"
    if len(work.rank_s) != layout.devices:
        return f"CPU-seconds of {len(work.rank_s)} colocated ranks do not match the layout's {layout.devices}; {probe}"
    if layout.gen_devices_per_replica > 1:
        return (f"CPU-seconds of ranks generating on a whole model do not price replicas of "
                f"{layout.gen_devices_per_replica} devices: use --gen-ep 1 with this probe")
    if (work.staleness == 0) != (layout.staleness == 0):
        return (f"CPU-seconds probed at k = {work.staleness} do not price a colocated job at k = {layout.staleness} "
                f"({'the phases take turns' if layout.staleness == 0 else 'generation runs beside the update'}); "
                f"{probe}")
    return None


def role_cpu_mismatch(work: RoleCPU, layout: RLLayout) -> str | None:
    """Why ``work``'s processes are not ``layout``'s (None: they are): the probe measures one-rank replicas
    (``moetrain.rl.rates.check_role_cpu_job``), one work per replica and per trainer rank. The one rule of
    ``simulate --rl`` (which refuses such a layout) and ``plan --rl`` (which leaves it out and says so)."""
    shape = (len(work.rollout_s), len(work.trainer_s))
    if shape != (layout.generating_devices, layout.train_devices):
        return (f"CPU-seconds of {shape[0]} rollout and {shape[1]} trainer processes do not match the layout's "
                f"{layout.generating_devices} and {layout.train_devices}; probe this layout's job "
                "(`moetrain profile --rl-out FILE --rl-job rl.yaml`)")
    if layout.gen_devices_per_replica > 1:
        return (f"CPU-seconds of one-rank rollout replicas do not price replicas of {layout.gen_devices_per_replica} "
                "devices: use --gen-ep 1 with this probe")
    return None


def training_prediction(w: RLWorkload, layout: RLLayout, calibration: Calibration):
    """The planner's step for the training layout on the step's samples (``LayoutPrediction``), as this
    project's runtime trains it (``moetrain rl``): ZeRO reduces the gradients in the optimizer step, after
    the backward (nothing hides them), the tensor-parallel collectives are synchronous, a reduce-scatter
    runs as an all-reduce (``Workload.reduce_scatter_by_all_reduce``), tensor parallelism is the
    project's (``Workload.project_tensor_parallel``: whole head and shared expert, the routers' gathers),
    the dispatch gathers the per-expert counts first (``Workload.expert_count_exchange``) and the head runs on
    the completion tokens only (``Workload.head_share``)."""
    return simulate_layout(training_workload(w), layout.train, layout.train_devices, calibration)


def training_workload(w: RLWorkload) -> Workload:
    """The step's samples as the training runtime of ``moetrain rl`` trains them (``training_prediction``):
    what the RL planner's trainer search (``moetrain.planner.rl_search``) ranks layouts on."""
    return runtime_workload(Workload(w.model, w.cluster, w.seq_len, w.samples, w.precision, head_share=w.head_share))


def _generation(w: RLWorkload, layout: RLLayout, eff: Efficiency, host: HostCosts) -> GenerationTimes:
    replica = Replica(w.samples // layout.replicas, layout.gen_devices_per_replica, host)
    return generation_time(w.samples_workload, replica, w.prompt_len, w.response_len, eff, w.decode_running_share)


def weight_bytes(w: RLWorkload) -> float:
    """Bytes of the whole model's weights as generation holds them (the training precision's width)."""
    return count_params(w.model).total * (4.0 if w.precision == "fp32" else 2.0)


def _shards(train: ParallelConfig) -> int:
    """Devices one training replica's weights are split over: pipeline stages times the wider of the
    dense (tp) and the expert (ep·etp) split."""
    return train.pp * max(train.tp, train.ep * train.etp)


def _host_copy_time(num_bytes: float, w: RLWorkload, layout: RLLayout, eff: Efficiency) -> float:
    if layout.host_link_gbps is None:  # host memory is device memory: a copy reads and writes
        return float(memory_time(2.0 * num_bytes, w.cluster, eff))
    return num_bytes / (layout.host_link_gbps * 1e9)


@dataclass(frozen=True)
class _Transfers:
    offload_s: float = 0.0
    reshard_s: float = 0.0
    restore_s: float = 0.0
    push_s: float = 0.0


def _buckets(num_bytes: float, layout: RLLayout) -> float:
    """Messages of the weight sync for ``num_bytes`` (0 without a bucket size)."""
    return float(ceil(num_bytes / layout.sync_bucket_bytes)) if layout.sync_bucket_bytes else 0.0


def _split_bytes(w: RLWorkload) -> tuple[float, float]:
    """(dense, routed-expert) bytes of the whole model's weights as generation holds them."""
    counts = count_params(w.model)
    width = weight_bytes(w) / counts.total
    return (counts.total - counts.experts) * width, counts.experts * width


def _reshard_bytes(w: RLWorkload, layout: RLLayout) -> tuple[float, float]:
    """(bytes one generating device already holds from training, bytes of the weights some generating device
    lacks). Training splits the dense weights over pp·tp devices and the routed experts over pp·ep·etp; a
    generation replica holds the dense weights whole and the experts split over its devices (whose shares
    are contiguous, as the training shares: a generation share within a training share is local)."""
    train, per_replica = layout.train, layout.gen_devices_per_replica
    dense, experts = _split_bytes(w)
    dense_split, expert_split = train.pp * train.tp, train.pp * train.ep * train.etp
    local = dense / dense_split + experts / max(expert_split, per_replica)
    lacked = (dense if dense_split > 1 else 0.0) + (experts if expert_split > per_replica else 0.0)
    return local, lacked


def _colocated_transfers(w: RLWorkload, layout: RLLayout, eff: Efficiency, sync: SyncRates | None) -> _Transfers:
    """The reshard as the runtime's weight sync runs it (``distributed.weight_sync``): every rank walks the
    same list of buckets in one global order (each owner's buckets together), a bucket's owner packs it (a
    copy and a CRC-32 of its bytes), sends it once (a broadcast to every receiver), and its receivers write
    and check it (a copy and a CRC-32), before anyone moves to the next bucket; a device's boxes that it
    already holds go through the same pack and write as a bucket of its own, in its turn. So the buckets
    run one after the other on the whole world:

        reshard = lacked / link + buckets(lacked) · latency                  (each bucket one message)
                  + (devices · local + lacked) · 2 · (1 / copy rate + 1 / CRC-32 rate)   (with ``SyncRates``)
                  + all-reduce of an 8-byte flag over every device                      (the agreement)

    where ``local`` is what each device already holds and ``lacked`` what some device lacks
    (``_reshard_bytes``): each lacked byte is packed and sent once, and written by its receivers at once."""
    shards = _shards(layout.train)
    local_params = count_params(w.model).total / shards
    offload = (_host_copy_time(OFFLOAD_BYTES_PER_PARAM * local_params, w, layout, eff) if layout.offload else 0.0)
    local, lacked = _reshard_bytes(w, layout)
    cross_node = layout.devices > w.cluster.fabric_devices
    reshard = 0.0
    if lacked > 0:
        messages = max(_buckets(lacked, layout), 1.0)
        reshard = float(p2p_time(lacked, cross_node, w.cluster, eff))
        reshard += (messages - 1.0) * float(p2p_time(0.0, cross_node, w.cluster, eff))
    if sync is not None:
        reshard += sync.seconds(2.0 * (layout.devices * local + lacked)) + _agreement(w, layout.devices, eff)
    return _Transfers(offload_s=offload, reshard_s=reshard, restore_s=offload)


def _agreement(w: RLWorkload, devices: int, eff: Efficiency) -> float:
    """The sync's last step: one all-reduce of a flag over every rank of the sync."""
    in_node = ranks_per_node(devices, 1, w.cluster.fabric_devices)
    return float(allreduce_time(8.0, devices, in_node, w.cluster, eff))


def _push_time(w: RLWorkload, layout: RLLayout, eff: Efficiency, sync: SyncRates | None) -> float:
    """Every rollout device receives its replica's share; the training devices send replicas × the weights
    between them; the slower side sets the time (one link each, the network when the job spans nodes),
    one latency per bucket beyond the first. With ``sync``: the sender packs and the receiver writes and
    checks every byte, one bucket after the other (2 × the bytes), then the agreement's all-reduce."""
    cross_node = layout.devices > w.cluster.fabric_devices
    received = weight_bytes(w) / layout.gen_devices_per_replica
    sent = layout.replicas * weight_bytes(w) / layout.train_devices
    moved = max(received, sent)
    push = float(p2p_time(moved, cross_node, w.cluster, eff))
    push += max(_buckets(moved, layout) - 1.0, 0.0) * float(p2p_time(0.0, cross_node, w.cluster, eff))
    if sync is not None:
        push += sync.seconds(2.0 * received) + _agreement(w, layout.devices, eff)
    return push


def _pack_time(w: RLWorkload, layout: RLLayout, sync: SyncRates | None) -> float:
    """A training device's packing of its share of a push: one copy and one CRC-32 of each byte it owns,
    once whatever the replicas (a bucket is packed once and sent to every replica at once:
    ``WeightSync.start``). The T training devices pack their shares side by side."""
    if sync is None:
        return 0.0
    return sync.seconds(weight_bytes(w) / layout.train_devices)


def _unpacked_push_time(push_s: float, w: RLWorkload, sync: SyncRates | None) -> float:
    """What is left of a background push once the training devices have packed every bucket (the whole
    model's pack, done on their side before the transfer): the transfer, the replicas' writes and checks,
    the agreement. With one training device: the push less its packing."""
    return push_s - (sync.seconds(weight_bytes(w)) if sync is not None else 0.0)


def _gather_time(w: RLWorkload, layout: RLLayout, eff: Efficiency) -> float:
    """Colocated: every rank gathers the generated rows of every replica (the runtime's object all-gather:
    one all-gather of the sizes, one of the rows: token ids (8 B), log-probs (4 B) and, for MoE models,
    the replay record (8 B per token, MoE layer and routed expert))."""
    if layout.replicas <= 1:
        return 0.0
    moe = w.model.moe
    per_token = 12.0 + (8.0 * w.model.num_moe_layers * moe.router.top_k if moe is not None else 0.0)
    rows_bytes = w.samples * (w.prompt_len + w.response_len) * per_token
    in_node = ranks_per_node(layout.devices, 1, w.cluster.fabric_devices)
    return float(allgather_time(rows_bytes, layout.devices, in_node, w.cluster, eff)
                 + allgather_time(8.0 * layout.devices, layout.devices, in_node, w.cluster, eff))


def overlapped_time(a: float, b: float, shared_cores: float | None = None,
                    processes: tuple[int, int] = (1, 1)) -> float:
    """Two jobs that take ``a`` and ``b`` seconds alone, run at once. On separate devices: the longer. On
    ``shared_cores`` cores' worth of compute (processor sharing, each process at most one core), where
    job a runs as ``processes[0]`` processes and job b as ``processes[1]`` (each process of a job doing
    that job's seconds of work: R rollout replicas, a trainer group's ranks): all n = n_a + n_b run at
    min(1, c/n) until the shorter job's work is done, the rest of the longer job's at min(1, c/n_longer).
    One process each: c = 2 gives the longer, c = 1 the sum."""
    if shared_cores is None:
        return max(a, b)
    (short, _), (long, long_processes) = sorted(((a, processes[0]), (b, processes[1])))
    together = min(1.0, shared_cores / (processes[0] + processes[1]))
    alone = min(1.0, shared_cores / long_processes)
    return short / together + (long - short) / alone


def colocated_overlap(generation_s: float, generation_device_s: float, train_s: float,
                      shared_cores: float | None = None) -> float:
    """Generation of the next batch beside the update on the same devices (colocated, k ≥ 1). On a CPU whose
    cores the two threads share (``shared_cores``): processor sharing (``overlapped_time``). On an
    accelerator both run on one device: its work adds up, and only generation's host time beyond its device
    time (an eager stack's per-layer floor) is idle device time the update can fill:
    max(generation, generation's device time + update). That a decode step leaves compute idle while it
    reads memory, and an update the reverse, is not priced: the overlap of the two is taken as none."""
    if shared_cores is not None:
        return overlapped_time(generation_s, train_s, shared_cores)
    return max(generation_s, generation_device_s + train_s)


def price_rl_step(w: RLWorkload, layout: RLLayout, calibration: Calibration, host: HostCosts | None = None,
                  sync: SyncRates | None = None, training=None) -> RLStepPrediction:
    """One RL step of ``w`` in ``layout``; ``host``: the eager stack's host costs (measured; none by default);
    ``sync``: the weight sync's host work per byte (measured; the link alone by default); ``training``: the
    training step (``training_prediction``) when the caller has it already (a search pricing one training
    layout under many splits) or prices it with other rates than the other phases' (processes sharing a
    CPU's cores: a pipeline stage that waits leaves its share to the stages that compute, so the training
    layout's ranks compute faster than when every rank computes at once, as in generation); by default
    ``training_prediction(w, layout, calibration)``."""
    _check(w, layout)
    host, model = host or HostCosts(), PHASES_MODEL
    eff = calibration.for_device(w.cluster.device)
    training = training or training_prediction(w, layout, calibration)
    train_s, fits = float(training.step_time_s), bool(training.fits_memory)
    generation = _generation(w, layout, eff, host)
    gather = 0.0
    if layout.placement == "colocated" and w.logprob_on_generation:
        replica = Replica(w.samples, layout.gen_devices_per_replica, host)
        logprob = w.logprob_forwards * forward_time(w.samples_workload, replica, w.seq_len, eff,
                                                    layout.train.micro_batch, w.head_share)
    else:
        # A forward over the samples costs a third of training's forward + backward (backward = 2 forwards).
        logprob = w.logprob_forwards * (train_s - float(training.optimizer_s)) / 3.0
    if layout.placement == "colocated":
        moves = _colocated_transfers(w, layout, eff, sync)
        gather = _gather_time(w, layout, eff)
        serial = gather + w.reward_s + logprob + moves.reshard_s
        if layout.rank_cpu is not None:  # one CPU: the ranks' measured work shares its cores
            assert layout.shared_cores is not None
            step, model = colocated_cpu_step(layout.rank_cpu, layout.shared_cores), SHARED_CPU_MODEL
        elif layout.staleness:  # the next batch generates beside the update (moetrain.rl.colocated)
            device_s = _generation(w, layout, eff, HostCosts()).total_s  # without the host's floor
            step = serial + colocated_overlap(generation.total_s, device_s, train_s, layout.shared_cores)
        else:
            step = serial + generation.total_s + train_s + moves.offload_s + moves.restore_s
    else:
        moves = _Transfers(push_s=_push_time(w, layout, eff, sync))
        rollout_side = generation.total_s + w.reward_s
        train_side = logprob + train_s
        if layout.staleness == 0:
            step = rollout_side + train_side + moves.push_s
        else:
            # The trainer pushes in the background (``WeightSync.start``): its step pays the packing; the
            # transfer and the receiver's check run before the rollout side's next generation.
            pack = _pack_time(w, layout, sync)
            if layout.role_cpu is not None:  # one CPU: the processes' measured work shares its cores
                assert layout.shared_cores is not None
                step, model = shared_cpu_step(layout.role_cpu, layout.shared_cores), SHARED_CPU_MODEL
            else:
                step = overlapped_time(rollout_side + _unpacked_push_time(moves.push_s, w, sync),
                                       train_side + pack, layout.shared_cores,
                                       (layout.generating_devices, layout.train_devices))
    phases = RLPhases(generate_s=generation.total_s, prefill_s=generation.prefill_s, decode_s=generation.decode_s,
                      reward_s=w.reward_s, logprob_s=logprob, train_s=train_s,
                      offload_s=moves.offload_s, reshard_s=moves.reshard_s, restore_s=moves.restore_s,
                      push_s=moves.push_s, gather_s=gather)
    return RLStepPrediction(
        placement=layout.placement, staleness=layout.staleness, devices=layout.devices,
        train_devices=layout.train_devices, generating_devices=layout.generating_devices, replicas=layout.replicas,
        phases=phases, step_s=step, generated_tokens_per_s=w.generated_tokens / step,
        tokens_per_s=w.samples * (w.prompt_len + w.response_len) / step,
        decode_memory_bound=generation.decode_memory_bound, train_fits_memory=fits, step_model=model)
