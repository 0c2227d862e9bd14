"""What the runtime's parts share, below memory, the distributed runtime and the training loop:
autocast precision (``precision``), AdamW and its warm-up/cosine schedule (``optim``), keeping freed host
memory (``host_memory``), the torchrun restart bookkeeping and a failed rank's report (``recovery``), and the
checkpoint folder format: naming, sealing, verifying, choosing the one to resume (``checkpoint_files``),
and the decorator that keeps host-side code out of compiled graphs without loading the compiler on import
(``eager_only``).

It imports nothing from ``moetrain.memory``, ``moetrain.distributed`` or ``moetrain.train``.
"""
