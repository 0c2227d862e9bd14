import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from moetrain.rl.config import GRPOConfig
from moetrain.rl.grpo import (
    OtherLogprobs,
    PolicyObjective,
    ScoredTokens,
    StepStats,
    group_advantages,
    grpo_loss,
    grpo_token_loss,
    label_positions,
    token_logprobs,
)

CFG = GRPOConfig(group_size=4, clip_low=0.2, clip_high=0.28, is_cap=2.0)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    std3 = math.sqrt((3 * 0.0625 + 0.5625) / 3)  # of (1, 1, 1, 0): mean 0.75
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0, 0, 0, 0,
                0.25 / (std3 + 1e-4), 0.25 / (std3 + 1e-4), 0.25 / (std3 + 1e-4), -0.75 / (std3 + 1e-4)]
    torch.testing.assert_close(group_advantages(rewards, 4), torch.tensor(expected))
    torch.testing.assert_close(group_advantages(rewards, 4, scale_rewards=False)[:4], torch.tensor([.5, -.5, -.5, .5]))


def test_one_update_loss_and_gradient_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rollout = torch.tensor([[-1.1, -2.0, -9.0]])
    advantages = torch.tensor([[1.0, -1.0, 5.0]])
    mask = torch.tensor([[True, True, False]])
    loss = grpo_loss(logp, ScoredTokens(rollout, advantages, mask), CFG)
    w = math.exp(0.1)  # truncated importance weight exp(old − rollout), old = logp before the step
    assert loss.item() == pytest.approx((-1.0 * w + 1.0 * 1.0) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-w / 2, 0.5, 0.0]]))


def test_clip_truncation_and_kl_by_hand():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.5, -1.5, -0.5, -1.0])
    rollout = torch.tensor([-1.1, -1.5, -0.5, -3.0])
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    ref = torch.tensor([-1.2, -1.0, -1.0, -1.0])
    cfg = CFG.model_copy(update={"kl_coef": 0.1})
    terms = grpo_token_loss(logp, ScoredTokens(rollout, advantages, torch.ones(4, dtype=torch.bool), old, ref), cfg)
    r = math.exp(0.5)  # tokens 0, 1: ratio 1.6487 above 1 + 0.28
    r_low = math.exp(-0.5)  # token 2: ratio 0.6065 below 1 − 0.2
    kl0 = math.exp(-0.2) + 0.2 - 1
    expected = [
        -1.28 * math.exp(-0.4) + 0.1 * kl0,  # A > 0, ratio clipped at 1.28; weight exp(−1.5 + 1.1)
        r * 1.0,  # A < 0: −min(−r, −1.28) = r, not clipped (the pessimistic side)
        0.8 * 1.0,  # A < 0, ratio below 0.8: −min(−r_low, −0.8) = 0.8, clipped
        -1.0 * 2.0,  # ratio 1, weight exp(2) truncated to 2
    ]
    torch.testing.assert_close(terms.loss_BS, torch.tensor(expected))
    assert terms.clipped_BS.tolist() == [True, False, True, False]
    assert terms.truncated_BS.tolist() == [False, False, False, True]
    assert r_low < 0.8
    terms.loss_BS.sum().backward()
    # clipped tokens keep only the KL gradient; token 1 keeps −A·r·w = r; token 3 −A·w = −2
    kl_grad0 = 0.1 * (1 - math.exp(-0.2))  # d/dlogp of exp(ref − logp) − (ref − logp) − 1
    torch.testing.assert_close(logp.grad, torch.tensor([kl_grad0, r, 0.0, -2.0]))


def test_label_positions_are_the_flat_row_major_label_slots():
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, -100, 7], [1, -100, -100, -100]])
    assert label_positions(labels).tolist() == [1, 2, 7, 8]


def test_the_objective_on_label_positions_equals_the_loss_on_full_sequences():
    # the step computes the head only at the completion tokens: same loss, gradient and statistics as
    # GRPO on the full [B, S, V] logits with the label mask
    generator = torch.Generator().manual_seed(0)
    logits_BSV = torch.randn(3, 5, 11, generator=generator, dtype=torch.float64)
    labels_BS = torch.tensor([[-100, -100, 3, 4, -100], [-100, 7, 1, 2, 9], [-100, -100, -100, -100, 0]])
    rollout_BS = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    advantages_BS = torch.tensor([[0.5] * 5, [-1.0] * 5, [2.0] * 5], dtype=torch.float64)
    ref_BS = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    cfg = CFG.model_copy(update={"kl_coef": 0.05, "temperature": 0.7})
    mask_BS = labels_BS != -100

    full = logits_BSV.clone().requires_grad_(True)
    terms = grpo_token_loss(token_logprobs(full, labels_BS, cfg.temperature),
                            ScoredTokens(rollout_BS, advantages_BS, mask_BS, ref_logp_BS=ref_BS), cfg)
    terms.loss_BS.sum().backward()

    stats = StepStats.zeros(torch.device("cpu"), keep_logprobs=True)
    objective = PolicyObjective.of_rows(labels_BS, rollout_BS, advantages_BS, cfg, stats, OtherLogprobs(ref_BS))
    assert objective.index_T.tolist() == [2, 3, 6, 7, 8, 9, 14]
    picked = logits_BSV.clone().requires_grad_(True)
    loss = objective.loss_sum(picked.reshape(-1, 11).index_select(0, objective.index_T))
    loss.backward()
    torch.testing.assert_close(loss, terms.loss_BS.sum())
    torch.testing.assert_close(picked.grad, full.grad)
    assert picked.grad[~mask_BS].abs().sum() == 0  # nothing flows to a prompt or padding position
    assert stats.sums[0].item() == 7  # the scored tokens
    torch.testing.assert_close(stats.logprobs[0], token_logprobs(logits_BSV, labels_BS, 0.7)[mask_BS])



def test_the_objective_carries_the_proximal_and_reference_log_probs_to_the_loss():
    # the decoupled loss (π_old apart from the trained weights) with a KL term: on label positions, the same
    # per-token loss as on full sequences; without π_old the ratio would be 1 and the weights exp(logp − μ)
    generator = torch.Generator().manual_seed(1)
    logits_BSV = torch.randn(2, 4, 7, generator=generator, dtype=torch.float64)
    labels_BS = torch.tensor([[-100, 3, 4, -100], [-100, -100, 1, 6]])
    rollout_BS, old_BS, ref_BS = (-torch.rand(2, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    advantages_BS = torch.tensor([[1.0] * 4, [-0.5] * 4], dtype=torch.float64)
    cfg = CFG.model_copy(update={"kl_coef": 0.1})
    logp_BS = token_logprobs(logits_BSV, labels_BS, cfg.temperature)
    full = grpo_token_loss(logp_BS, ScoredTokens(rollout_BS, advantages_BS, labels_BS != -100, old_BS, ref_BS), cfg)
    objective = PolicyObjective.of_rows(labels_BS, rollout_BS, advantages_BS, cfg,
                                        StepStats.zeros(torch.device("cpu")), OtherLogprobs(ref_BS, old_BS))
    loss = objective.loss_sum(logits_BSV.reshape(-1, 7).index_select(0, objective.index_T))
    torch.testing.assert_close(loss, full.loss_BS.sum())
    on_policy = grpo_token_loss(logp_BS, ScoredTokens(rollout_BS, advantages_BS, labels_BS != -100,
                                                      ref_logp_BS=ref_BS), cfg)
    assert not torch.isclose(loss, on_policy.loss_BS.sum())

def test_token_logprobs_are_tempered_and_masked():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]])
    labels = torch.tensor([[0, -100]])
    out = token_logprobs(logits, labels, temperature=2.0)
    assert out[0, 0].item() == pytest.approx(1.0 - math.log(math.exp(1.0) + 1 + math.exp(-0.5)))
    assert out[0, 1].item() == 0.0


def test_equals_trl_grpo_loss_on_the_same_tensors():
    """TRL's GRPOTrainer._compute_loss, run on a stand-in trainer whose model returns our log-probs."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    torch.manual_seed(0)
    batch, length = 6, 5
    logp = (-torch.rand(batch, length) * 3).requires_grad_(True)
    rollout = logp.detach() + 0.3 * torch.randn(batch, length)  # an engine that disagrees a little
    ref = logp.detach() + 0.2 * torch.randn(batch, length)
    mask = torch.ones(batch, length)
    mask[0, 3:] = mask[4, 1:] = 0
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    cfg = GRPOConfig(group_size=3, clip_low=0.2, clip_high=0.28, is_cap=2.0, kl_coef=0.05)
    advantages = group_advantages(rewards, 3)

    ours = grpo_loss(logp, ScoredTokens(rollout, advantages[:, None].expand(-1, length), mask.bool(), ref_logp_BS=ref),
                     cfg)
    (our_grad,) = torch.autograd.grad(ours, logp)

    logp_trl = logp.detach().clone().requires_grad_(True)
    accelerator = SimpleNamespace(gather=lambda t: t, reduce=lambda t, reduction="sum": t,
                                  gather_for_metrics=lambda t: t, num_processes=1, sync_gradients=True)
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_trl, torch.zeros(batch, length), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=cfg.kl_coef, loss_type="bnpo", epsilon_low=cfg.clip_low, epsilon_high=cfg.clip_high,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False), use_vllm=True,
        vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), accelerator=accelerator)
    old = logp.detach()  # TRL's old_per_token_logps: the trainer's forward before the update
    inputs = {"prompt_ids": torch.zeros(batch, 2, dtype=torch.long), "prompt_mask": torch.ones(batch, 2),
              "completion_ids": torch.zeros(batch, length, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              # TRL's token_truncate importance ratio, as its generation step computes it
              "importance_sampling_ratio": torch.clamp(torch.exp((old - rollout) * mask), max=cfg.is_cap)}
    theirs = grpo_trainer.GRPOTrainer._compute_loss(stub, None, inputs)
    (their_grad,) = torch.autograd.grad(theirs, logp_trl)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_grad, their_grad, atol=1e-6, rtol=1e-6)
