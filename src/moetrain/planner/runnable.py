"""Which candidate layouts the runtime can run: ``moetrain.config.parallel.runtime_limits`` over arrays.

The search screens millions of layouts, so the rules are applied as one numpy mask per batch; a test
holds this mask and the scalar function to the same answer on enumerated layouts.
"""

from __future__ import annotations

import numpy as np

from moetrain.planner.strategy import A2A_NAMES, Strategies

HIERARCHICAL = A2A_NAMES.index("hierarchical")


def runnable_mask(s: Strategies, num_layers: int, global_batch: int, ranks_per_node: int | None) -> np.ndarray:
    """True where ``runtime_limits`` of the layout is empty."""
    chunks = s.pp * s.vpp
    ok = chunks <= num_layers
    micro_per_replica = global_batch // np.maximum(s.dp * s.micro_batch, 1)
    ok &= (s.vpp == 1) | (micro_per_replica % s.pp == 0)
    ok &= (s.tp == 1) | s.sp.astype(bool)
    hierarchical = (s.a2a == HIERARCHICAL) & (s.ep > 1)
    ok &= ~hierarchical | (s.etp == 1)
    if ranks_per_node is not None:
        ok &= ~hierarchical | (s.ep % ranks_per_node == 0) | (ranks_per_node % s.ep == 0)
    ok &= (s.zero < 2) | ~s.overlap.astype(bool)
    return ok
