import torch
from rl_models import small_model

from moetrain.config import load_model_config
from moetrain.models.router import Router
from moetrain.rl.generate import RolloutEngine, SamplingParams
from moetrain.rl.replay import RoutingRecorder, routing_mismatch


def test_router_replays_the_given_experts_and_keeps_its_gradient():
    cfg = load_model_config("tiny-pangu").moe
    router = Router(16, cfg.num_experts, cfg.router)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 16)
    own = router(x)
    replay = torch.stack([torch.randperm(cfg.num_experts)[: cfg.router.top_k] for _ in range(5)])
    replay[3] = -1  # no record: the router's own choice
    routing = router(x, replay)
    assert torch.equal(routing.expert_ids_TK[[0, 1, 2, 4]], replay[[0, 1, 2, 4]])
    assert torch.equal(routing.expert_ids_TK[3], own.expert_ids_TK[3])
    scores = router.scores(x)[1]
    weights = scores.gather(1, routing.expert_ids_TK)
    expected = weights / weights.sum(-1, keepdim=True) * cfg.router.scaling_factor
    torch.testing.assert_close(routing.weights_TK, expected)
    routing.weights_TK.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_makes_a_changed_router_use_generations_experts():
    model = small_model()
    prompts = [[1, 5, 6, 7], [1, 9, 4]]
    generation = RolloutEngine(model, pad_id=0).generate(prompts, SamplingParams(max_new_tokens=5, temperature=0))
    record = generation.expert_ids_BSMK
    # The trainer's weights moved since generation (an update, or other kernels): its routers choose anew.
    with torch.no_grad():
        for layer in model.layers:
            if layer.is_moe:
                layer.moe.router.weight.add_(0.5 * torch.randn_like(layer.moe.router.weight))
    lengths = [len(p) + int(n) - 1 for p, n in zip(prompts, generation.lengths_B)]
    seq = max(lengths)
    ids = torch.zeros(2, seq, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : lengths[row]] = torch.tensor((prompt + generation.completion(row))[:-1])
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(ids)
        free = recorder.take(2, seq)
        model(ids, expert_ids=record[:, :seq])
        replayed = recorder.take(2, seq)
    mask = ids != 0
    assert routing_mismatch(record[:, :seq], free, mask).layer_mismatch > 0.2
    assert routing_mismatch(record[:, :seq], replayed, mask).token_mismatch == 0.0


def test_routing_mismatch_by_hand():
    recorded = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[-1, -1], [-1, -1]]]])  # [1, 3, 2, 2]
    chosen = torch.tensor([[[[1, 0], [2, 3]], [[4, 5], [6, 8]], [[9, 9], [9, 9]]]])
    stats = routing_mismatch(recorded, chosen, torch.ones(1, 3, dtype=torch.bool))
    # token 0: same sets (order differs); token 1: layer 1 differs; token 2: no record
    assert (stats.num_tokens, stats.layer_mismatch, stats.token_mismatch) == (2, 0.25, 0.5)


def test_a_compiled_model_records_its_routing_in_one_graph_for_every_moe_layer():
    """The recorder's hooks must not make torch.compile build a graph per MoE layer: past its recompile limit
    (8) the remaining layers would run eager. Dynamo's guards decide this whatever the backend, so the
    ``eager`` backend checks it without Inductor's compile time. The record equals the eager model's."""
    from torch._dynamo.utils import counters

    from moetrain.distributed.parallelize import apply_compile

    model = small_model("tiny-qwen3", num_layers=6)  # 6 MoE layers, no dense one
    ids = torch.randint(0, model.cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    recorder = RoutingRecorder(model)
    with torch.no_grad(), recorder:
        model(ids)
        eager = recorder.take(2, 8)
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    apply_compile(model, backend="eager")
    with torch.no_grad(), recorder:
        model(ids)
        compiled = recorder.take(2, 8)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert eager.shape == (2, 8, 6, model.cfg.moe.router.top_k) and torch.equal(compiled, eager)
