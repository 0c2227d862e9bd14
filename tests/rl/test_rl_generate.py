import torch
import torch.nn.functional as F
from rl_models import small_model

from moetrain.models.attention import MLA
from moetrain.rl.generate import (
    RolloutEngine,
    SamplingParams,
    filter_logits,
    full_recompute_generate,
)
from moetrain.rl.kv_cache import new_cache
from moetrain.rl.replay import RoutingRecorder

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10], [1, 10, 11], [1, 20, 21, 22, 23]]


def test_kv_cache_generation_equals_full_recomputation_mla_and_gqa():
    for name in ("tiny-pangu", "tiny-qwen3"):
        model = small_model(name)
        generation = RolloutEngine(model, pad_id=0).generate(PROMPTS, SamplingParams(max_new_tokens=10,
                                                                                      temperature=0))
        tokens, logprobs = full_recompute_generate(model, PROMPTS, 10)
        for row in range(len(PROMPTS)):
            assert generation.completion(row) == tokens[row], name
            torch.testing.assert_close(generation.logprobs_BN[row], torch.tensor(logprobs[row]), atol=1e-5, rtol=0)


def test_replay_record_holds_the_experts_of_every_input_token():
    model = small_model()
    generation = RolloutEngine(model, pad_id=0).generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    record = generation.expert_ids_BSMK
    assert record is not None and record.shape == (5, 9 + 6, 2, 4)
    for row, prompt in enumerate(PROMPTS):
        sequence = prompt + generation.completion(row)
        inputs = sequence[:-1]  # the last token is never fed back
        with RoutingRecorder(model) as recorder:
            model(torch.tensor([inputs]))
            expected = recorder.take(1, len(inputs))[0]
        assert torch.equal(record[row, : len(inputs)].sort(-1).values, expected.sort(-1).values)
        assert (record[row, len(inputs):] == -1).all()


def test_mla_caches_the_latent_and_the_shared_rope_key_only():
    attention = small_model().layers[0].attention
    assert isinstance(attention, MLA)
    cache = new_cache(attention, rows=3, slots=11, device=torch.device("cpu"), dtype=torch.float32)
    cfg = attention.cfg
    assert {k: tuple(v.shape) for k, v in cache.tensors.items()} == {
        "latent": (3, 11, cfg.kv_lora_rank), "k_rope": (3, 11, cfg.qk_rope_head_dim)}


def test_finished_rows_leave_the_batch_and_each_row_equals_generating_it_alone():
    model = small_model()
    engine = RolloutEngine(model, pad_id=0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    first = engine.generate(PROMPTS, greedy)
    stop = first.completion(1)[2]  # row 1 stops at its third token (others may too)
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,))
    limits = [8, 8, 2, 5, 8]
    rows_per_forward = []
    hook = model.embed.register_forward_hook(lambda m, args, out: rows_per_forward.append(out.shape[0]))
    generation = engine.generate(PROMPTS, params, max_new_tokens=limits)
    hook.remove()
    assert rows_per_forward[0] == 5 and rows_per_forward == sorted(rows_per_forward, reverse=True)
    assert sum(rows_per_forward[1:]) == generation.rows_computed < 5 * generation.decode_steps
    for row, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], params, max_new_tokens=[limits[row]])
        assert generation.completion(row) == alone.completion(0)
        assert int(generation.lengths_B[row]) <= limits[row]
        completion = generation.completion(row)
        assert bool(generation.stopped_B[row]) == (completion[-1] == stop)
        assert stop not in completion[:-1]


def test_stop_strings_end_a_row():
    model = small_model()
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)
    engine = RolloutEngine(model, pad_id=0, decode=decode)
    free = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, temperature=0))
    text = decode(free.completion(0))
    stopped = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, temperature=0, stop_strings=(text[1:3],)))
    assert stopped.completion(0) == free.completion(0)[:3] and bool(stopped.stopped_B[0])


def test_sampling_is_seeded_top_k_one_is_greedy_and_logprobs_are_tempered():
    model = small_model()
    engine = RolloutEngine(model, pad_id=0)
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    run = lambda p, seed: engine.generate(PROMPTS, p, torch.Generator().manual_seed(seed))
    a, b, c = run(params, 1), run(params, 1), run(params, 2)
    assert torch.equal(a.tokens_BN, b.tokens_BN) and not torch.equal(a.tokens_BN, c.tokens_BN)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    top1 = run(SamplingParams(max_new_tokens=6, temperature=0.7, top_k=1), 3)
    assert torch.equal(top1.tokens_BN, greedy.tokens_BN)
    nucleus = run(SamplingParams(max_new_tokens=6, temperature=0.7, top_p=1e-6), 3)
    assert torch.equal(nucleus.tokens_BN, greedy.tokens_BN)
    # each sampled token's log-prob is log_softmax(logits / T) of the model at that point
    for row, prompt in enumerate(PROMPTS):
        sequence = prompt + a.completion(row)
        with torch.no_grad():
            logits = model(torch.tensor([sequence[:-1]])).logits[0, len(prompt) - 1:].float()
        expected = F.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(a.completion(row))[:, None])[:, 0]
        torch.testing.assert_close(a.logprobs_BN[row, : len(expected)], expected, atol=1e-5, rtol=0)


def test_filter_logits_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda out: (out > float("-inf")).int().tolist()[0]
    assert keep(filter_logits(logits, top_k=2, top_p=1.0)) == [1, 1, 0, 0]
    assert keep(filter_logits(logits, top_k=0, top_p=0.79)) == [1, 1, 0, 0]  # 0.5 + 0.3 reaches 0.79
    assert keep(filter_logits(logits, top_k=0, top_p=0.81)) == [1, 1, 1, 0]
    assert keep(filter_logits(logits, top_k=0, top_p=0.4)) == [1, 0, 0, 0]
