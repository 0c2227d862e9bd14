"""Small RL policies for the tests."""

from moetrain.config import load_model_config
from moetrain.models.transformer import build_model
from moetrain.rl.loop import policy_config


def small_model(name: str = "tiny-pangu", seed: int = 0, **update):
    """A preset without MTP (the RL policy), 4 layers (2 dense, 2 MoE for tiny-pangu), in eval mode."""
    cfg = policy_config(load_model_config(name)).model_copy(update={"num_layers": 4, **update})
    return build_model(cfg, "cpu", seed=seed).eval()
