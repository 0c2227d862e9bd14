"""What the distributed runtime and the training loop share, below both of them: autocast precision
(``precision``), AdamW and its warm-up/cosine schedule (``optim``), keeping freed host memory
(``host_memory``), the torchrun restart bookkeeping and a failed rank's report (``recovery``), and the
checkpoint folder format: naming, sealing, verifying, choosing the one to resume (``checkpoint_files``).

It imports nothing from ``moetrain.distributed`` or ``moetrain.train``.
"""
