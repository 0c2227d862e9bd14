"""The distributed runtime on torch.distributed (gloo on CPU, NCCL on GPU).

- ``layout``: ``ParallelDims`` (validated degrees, named process groups from one rank grid) and
  ``validate_layout`` (refuses a layout before any process starts);
- ``parallelize``: applies pipeline split, tensor + sequence parallelism (``tp``) and expert
  parallelism (``ep``: flat or hierarchical all-to-all, expert placement table) to a built model;
- ``pipeline``: the executor of the per-rank step lists of ``moetrain.schedules`` (1F1B, interleaved
  1F1B, overlapped; torch-free, beside the package so the planner simulates them too); ``overlap``:
  two micro-batches taking turns at every exchange, expert weight gradients computed apart;
- ``zero``: ZeRO-1 AdamW over the data-parallel and expert-data-parallel groups;
- ``step``: the training step of a layout and the single-process reference;
- ``checkpoint``: DCP save/load under the single-process names and global shapes (loads under any
  layout);
- ``launch`` / ``worker``: torchrun start-up and failure reporting; ``trace``: per-rank timelines.
"""
