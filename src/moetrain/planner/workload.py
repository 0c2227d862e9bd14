"""What is trained, on what, with which batch: the planner's input besides the parallel strategy."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.planner.documents import DocumentPacking

BF16 = 2.0


@dataclass(frozen=True)
class Workload:
    """What is trained, on what, with which batch: everything but the parallel strategy."""

    model: ModelConfig
    cluster: ClusterConfig
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    precision: str = "bf16"
    """GEMM precision: bf16, fp16, fp8 (linear layers only) or fp32 (CPU runs)."""
    imbalance: float = 1.0
    """Routed-token load of the hottest EP rank over the mean (1.0 = perfectly balanced)."""
    flash_attention: bool = True
    grad_bytes: float = 4.0
    """Gradient element size in the reduction (fp32 accumulation; 2 for fp16 runs)."""
    overlap_grad_comm: bool = True
    """The framework overlaps data-parallel gradient/parameter traffic with compute (bucketed reduction
    during backward, parameter prefetch): Megatron-Core, FSDP, DeepSpeed ZeRO-3. False for stacks that
    reduce after the backward (Megatron-LM 2021)."""
    overlap_tp_comm: bool = True
    """The framework can hide tensor-parallel collectives under GEMMs (Transformer Engine userbuffers,
    torch AsyncTP); ``Efficiency.tp_overlap`` says how much it hides. False for stacks whose TP
    all-reduces are synchronous (Megatron-LM 2021, Megatron-DeepSpeed: apart from the input gradients of
    ``async_tp_input_grad``)."""
    async_tp_input_grad: bool = True
    """In the backward, the column-parallel layers' input-gradient collectives run under those layers'
    weight-gradient GEMMs (Megatron's asynchronous tensor-parallel all-reduce, on by default in Megatron-LM
    since late 2021 and in Megatron-DeepSpeed since 2022, and Transformer Engine's Linear). False for this
    project's runtime and for Megatron-LM 2021, whose TP collectives wait in line."""
    reduce_scatter_by_all_reduce: bool = False
    """The framework reduce-scatters with an all-reduce of the whole buffer and keeps its shard (this
    project's runtime: ZeRO's gradient reduction, ``distributed.zero``, and the sequence-parallel exits,
    ``distributed.comm``, as gloo has no reduce-scatter): each such reduce-scatter costs an all-reduce,
    twice its ring price. False for stacks with a reduce-scatter (NCCL, HCCL)."""
    project_tensor_parallel: bool = False
    """Tensor parallelism as this project's runtime applies it (``distributed.tp``): in an MoE layer only
    attention is a tensor-parallel region (the shared expert, like the routed ones, runs whole on the
    rank's own sequence shard: no collectives of its own), the routers' balance losses all-gather their
    logits and scores over the group (and all-reduce the counts), and the output head runs whole on the
    gathered sequence on every rank (its vocabulary is not split). False: Megatron-style, the shared
    expert split like a dense FFN and the head's vocabulary over tp."""
    comm_overlap_stated: tuple[str, ...] = ()
    """Traffic the run's source says is overlapped with compute ("DP", "TP", "PP"): such traffic uses its
    whole physical overlap window (DP: the passes that produce or consume it; TP: the layer's compute)
    instead of the fitted shares ``grad_overlap`` / ``tp_overlap``, which price stacks that do not say."""
    attention_window: int = 0
    """Sliding-window length in tokens of the windowed attention layers (0: every layer attends to the
    whole causal context)."""
    window_layer_share: float = 0.0
    """Share of the layers whose attention is windowed (GPT-OSS alternates windowed and full layers: 0.5)."""
    rotary_embeddings: bool = True
    """Rotary position embeddings rotate q and k in every layer (the project's models, Llama, DeepSeek,
    GPT-OSS). False for learned absolute positions (GPT-3-style models) or ALiBi (MPT), which add no
    per-layer pass."""
    cp_gathers_mla_latent: bool = True
    """Context parallelism gathers MLA's compressed latent and shared rotary key (kv_lora_rank +
    qk_rope_head_dim per token) before the up-projection, as this project's runtime does
    (``moetrain.distributed.cp``). False for stacks that exchange the up-projected keys and values
    (Megatron-Core's ring CP), which the published rows ran."""
    bidirectional_pairing: bool = False
    """The paired schedule is DualPipe's (DeepSeek-V3 §3.2.1: micro-batches fed from both ends of the
    pipeline), not this project's paired 1F1B: pairing starts after about pp chunk units on every rank and
    never serialises the pipeline. The published DualPipe run is read this way."""
    split_weight_grad: bool = False
    """The stack computes weight gradients apart from input gradients and schedules them under the
    all-to-all (MindSpeed's ``--moe-fb-overlap``, Megatron-Core's ``--delay-wgrad-compute``, DualPipe): a
    warm-up or cool-down pass hides part of its own exchange (``layer_costs.unpaired_a2a_hidden``)."""
    fp8_stored_activations: bool = False
    """FP8 runs keep the quantised copy of each linear layer's input for the weight gradient, at 1 byte
    instead of 2 (Transformer Engine; DeepSeek-V3 §3.3.2 caches them in FP8). False for torchao's Float8
    linears, which save the high-precision input and quantise it again in the backward."""
    head_share: float = 1.0
    """Share of the sequence positions at which the output head and the loss run: 1 for language
    modelling; RL scores only the completion tokens (``RLWorkload.head_share``)."""
    expert_count_exchange: bool = False
    """The dispatcher gathers every EP rank's per-expert token counts in a collective of its own before
    each dispatch (this project's runtime, ``distributed.ep``: one all-gather per MoE layer forward, which
    sizes the all-to-all). False: the published runs, whose count synchronisation the fitted
    ``moe_overhead_us`` holds."""
    moe_padded_to_capacity: bool = False
    """The dispatcher drops the tokens above a fixed expert capacity and pads every expert's input up to it
    (Megatron-Core's ``moe_pad_expert_input_to_capacity``). The split sizes then follow from the tensor
    shapes, so the dispatch never copies the token counts to the host and waits for them (its ``preprocess``
    returns before choosing a sync point; the dropless path syncs before the all-to-all): the host issues
    the pass's kernels ahead of the device, and the fixed cost per pass (``moe_overhead_us``, the device
    idling behind the host after that sync) is not paid. Every expert then computes its capacity, the
    capacity factor times the balanced load, which ``imbalance`` carries."""
    documents: DocumentPacking | None = None
    """The sequences are packed from documents that attention must not cross (this project's data loader):
    the rows holding a boundary run their core attention again under the document mask, at the masked
    kernel's cost (``documents.core_time_factor``). None: every sequence is one stream, plain causal (the
    published runs, which attend across their packed documents or do not say)."""
    paired_count_sync_hidden: bool = True
    """In the overlapped schedule the stack issues the other micro-batch's half of a paired step before it waits
    on this half's token counts, and the counts' copy to the host waits for the counts alone (DualPipe interleaves
    the halves' kernels; Megatron-Core copies the counts on a stream of its own), so the device runs that half
    while the host waits: a paired pass pays no ``moe_overhead_us`` (``layer_costs.moe_pass_seconds``). False
    for this project's runtime, which reads the counts on the compute stream without handing the turn to the
    other micro-batch (``distributed.ep._read_counts``): the read waits for everything queued before it, and
    the device idles as in an unpaired pass."""

    @property
    def activation_bytes(self) -> float:
        """Element size of activations and of what the collectives move (fp32 runs: 4)."""
        return 4.0 if self.precision == "fp32" else BF16


def runtime_workload(w: Workload) -> Workload:
    """The workload ``w`` asks for as this project's runtime trains it (``moetrain train`` and ``moetrain
    rl``): ``w``'s model, cluster, batch, precision, imbalance and head share; ZeRO reduces the gradients in
    the optimizer step, after the backward (nothing hides them); the tensor-parallel collectives are
    synchronous; a reduce-scatter runs as an all-reduce (gloo has none); tensor parallelism is the
    project's (whole head and shared expert, the routers' gathers); the dispatch gathers the per-expert
    counts first and reads them on the compute stream, so a paired pass still pays the count sync; gradients
    reduce in fp32 (fp16 runs: fp16); attention is fused unless the CPU kernel falls back to materialising the
    scores (it fuses only equal q/k and v head dims), over ``w``'s packed documents; every other field is the
    default (no stated overlap, no sliding window, …), whatever ``w`` says."""
    model, cluster = w.model, w.cluster
    flash = not cluster.host_is_device or model.attention.qk_head_dim == model.attention.v_head_dim
    return Workload(model, cluster, w.seq_len, w.global_batch, w.precision, w.imbalance, flash_attention=flash,
                    grad_bytes=2.0 if w.precision == "fp16" else 4.0, overlap_grad_comm=False,
                    overlap_tp_comm=False, async_tp_input_grad=False, reduce_scatter_by_all_reduce=True,
                    project_tensor_parallel=True, head_share=w.head_share, expert_count_exchange=True,
                    paired_count_sync_hidden=False, documents=w.documents)
