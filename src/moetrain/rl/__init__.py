"""RL post-training on the one training runtime: verifiable tasks, a KV-cache rollout engine that records
the experts it routed to, GRPO through ``train_step``, and router replay.

Modules, one concept each:
- ``tasks``: addition, sorting and countdown problems from a seed, with exact scorers and a held-out split;
- ``tokenizer``: the character tokenizer the task texts use;
- ``sft``: the supervised warm-up data on the task format (the ``step_batch`` interface of the trainer);
- ``kv_cache`` and ``generate``: batched generation with a KV cache (MLA caches its compressed latent);
- ``replay``: recording the experts generation chose and the replay diagnostics;
- ``grpo``: group-normalised advantages and the clipped, importance-weighted token loss;
- ``batch``: rollouts → the step's micro-batches (per-token objective, replay record);
- ``loop``: the RL trainer (the runtime's ``Trainer`` whose batches are fresh rollouts).

Torch is imported by the modules that need it; ``tasks`` and ``tokenizer`` are torch-free.
"""
