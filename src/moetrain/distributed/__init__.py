"""The distributed runtime on torch.distributed (gloo on CPU, NCCL on GPU).

- ``layout``: ``ParallelDims`` (validated degrees, named process groups from one rank grid) and
  ``validate_layout`` (refuses a layout before any process starts);
- ``parallelize``: applies pipeline split, tensor + sequence parallelism (``tp``) and expert
  parallelism (``ep``: flat or hierarchical all-to-all, expert placement table) to a built model;
- ``schedules`` (torch-free) and ``pipeline``: 1F1B / interleaved 1F1B as per-rank action lists and
  the executor that runs them;
- ``zero``: ZeRO-1 AdamW over the data-parallel and expert-data-parallel groups;
- ``step``: the training step of a layout and the single-process reference;
- ``launch`` / ``worker``: torchrun start-up and failure reporting; ``trace``: per-rank timelines.
"""
