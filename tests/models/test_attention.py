import torch

from moetrain.config import GQAConfig, MLAConfig
from moetrain.models.attention import GQA, MLA, build_attention_context
from moetrain.models.rope import Rotary


def _mla(backend: str) -> MLA:
    cfg = MLAConfig(num_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                    v_head_dim=10)
    torch.manual_seed(0)
    m = MLA(32, cfg, 1e-5, Rotary(10000.0), backend)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def _reference_padded_mla(m: MLA, x: torch.Tensor, ctx) -> torch.Tensor:
    """Straightforward MLA: concatenate q and k, pad V to the QK head dim, plain attention, slice."""
    cfg = m.cfg
    b, s, _ = x.shape
    from moetrain.models.rope import apply_rope, rope_cos_sin

    q = m.project_q(x).view(b, s, cfg.num_heads, cfg.qk_head_dim)
    latent, k_rope = m.kv_down(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
    kv = m.kv_up(m.kv_norm(latent)).view(b, s, cfg.num_heads, -1)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], -1)
    cos, sin = rope_cos_sin(ctx.positions_BS, cfg.qk_rope_head_dim, 10000.0)
    q = torch.cat([q[..., : cfg.qk_nope_head_dim], apply_rope(q[..., cfg.qk_nope_head_dim:], cos, sin)], -1)
    k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).expand(-1, -1, cfg.num_heads, -1)
    k = torch.cat([k_nope, k_rope], -1)
    v_padded = torch.nn.functional.pad(v, (0, cfg.qk_head_dim - cfg.v_head_dim))
    scores = torch.einsum("bshd,bthd->bhst", q, k) * cfg.qk_head_dim**-0.5
    mask = ctx.mask_B1SS if ctx.mask_B1SS is not None else torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhst,bthd->bshd", probs, v_padded)[..., : cfg.v_head_dim]
    return m.o_proj(out.reshape(b, s, -1))


def test_mla_without_padding_equals_padded_reference_both_backends():
    x = torch.randn(2, 9, 32)
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    for document_ids in (None, docs):
        ctx = build_attention_context(torch.zeros(2, 9, dtype=torch.long), document_ids)
        for backend in ("eager", "sdpa"):
            m = _mla(backend)
            assert torch.allclose(m(x, ctx), _reference_padded_mla(m, x, ctx), atol=1e-5), (backend, document_ids)


def test_packed_documents_equal_separate_sequences():
    cfg = GQAConfig(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    m = GQA(32, cfg, 1e-6, Rotary(10000.0), "sdpa")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    a, b = torch.randn(1, 5, 32), torch.randn(1, 7, 32)
    packed = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 5 + [1] * 7])
    ids = torch.zeros(1, 12, dtype=torch.long)
    out = m(packed, build_attention_context(ids, docs))
    out_a = m(a, build_attention_context(ids[:, :5], None))
    out_b = m(b, build_attention_context(ids[:, :7], None))
    assert torch.allclose(out, torch.cat([out_a, out_b], 1), atol=1e-5)


def test_gqa_eager_equals_sdpa():
    cfg = GQAConfig(num_heads=4, num_kv_heads=2, head_dim=8)
    eager, sdpa = GQA(32, cfg, 1e-6, Rotary(1e4), "eager"), GQA(32, cfg, 1e-6, Rotary(1e4), "sdpa")
    sdpa.load_state_dict(eager.state_dict())
    x = torch.randn(2, 6, 32)
    ctx = build_attention_context(torch.zeros(2, 6, dtype=torch.long), None)
    assert torch.allclose(eager(x, ctx), sdpa(x, ctx), atol=1e-5)


def _documents(rows: list[list[int]]) -> torch.Tensor:
    """Document ids from per-row document lengths."""
    return torch.tensor([[doc for doc, length in enumerate(lengths) for _ in range(length)] for lengths in rows])


def test_block_document_mask_equals_the_dense_one():
    """FlexAttention tiles (forward only: it has no CPU backward) against the dense boolean mask, for MLA
    (192/128-style unequal QK and V head dims) and grouped-query attention, over rows of several documents
    and of one; tiles of 128, so 300 positions put boundaries inside tiles and a partial last tile."""
    docs = _documents([[120, 5, 175], [300], [1, 298, 1]])
    ids = torch.zeros(docs.shape, dtype=torch.long)
    dense = build_attention_context(ids, docs)
    block = build_attention_context(ids, docs, document_mask="block")
    assert block.mask_B1SS is None and block.block_mask is not None
    assert torch.equal(block.positions_BS, dense.positions_BS)
    x = torch.randn(3, 300, 32)
    gqa = GQA(32, GQAConfig(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True), 1e-6, Rotary(1e4), "sdpa")
    with torch.no_grad():
        for module in (_mla("sdpa"), _mla("eager"), gqa):
            torch.testing.assert_close(module(x, block), module(x, dense), atol=2e-5, rtol=1e-4)


def test_block_mask_keeps_exactly_the_causal_same_document_pairs():
    """The tiles' mask function, evaluated on every (query, key) pair, is causal ∧ same document."""
    from moetrain.models.attention import document_block_mask

    docs = _documents([[3, 4, 1], [8]])
    mask_mod = document_block_mask(docs).mask_mod
    q, k = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    for b in range(2):
        expected = (q >= k) & (docs[b].view(8, 1) == docs[b].view(1, 8))
        assert torch.equal(mask_mod(torch.tensor(b), torch.tensor(0), q, k), expected)


def test_rows_inside_one_document_are_plain_causal_attention():
    """Rows that each lie inside one document are plain causal attention at positions 0..S-1: the
    context without documents equals the masked one (so the data loader drops their documents)."""
    ids = torch.zeros(2, 6, dtype=torch.long)
    masked = build_attention_context(ids, torch.zeros(2, 6, dtype=torch.long))
    plain = build_attention_context(ids, None)
    assert torch.equal(masked.positions_BS, plain.positions_BS)
    x = torch.randn(2, 6, 32)
    m = _mla("sdpa")
    torch.testing.assert_close(m(x, masked), m(x, plain), atol=1e-6, rtol=1e-5)


def _grads(module: torch.nn.Module, x: torch.Tensor, ctx) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = module(x, ctx)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out.detach(), [x.grad, *grads]


def test_masking_only_the_boundary_rows_equals_masking_every_row():
    """A micro-batch of two rows with a boundary and two without: masking only the boundary rows (the causal
    kernel over every row, the masked one over those rows in their place) gives the outputs and the
    gradients of masking every row, for both backends of MLA and for grouped-query attention."""
    from moetrain.data import boundary_rows

    docs = _documents([[120, 5, 175], [300], [1, 298, 1], [300]])
    rows = boundary_rows(docs)
    assert rows.tolist() == [0, 2]
    ids = torch.zeros(docs.shape, dtype=torch.long)
    every = build_attention_context(ids, docs)
    only = build_attention_context(ids, docs, boundary_rows_R=rows)
    assert only.mask_B1SS.shape[0] == 2 and torch.equal(only.positions_BS, every.positions_BS)
    x = torch.randn(4, 300, 32)
    gqa = GQA(32, GQAConfig(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True), 1e-6, Rotary(1e4), "sdpa")
    for module in (_mla("sdpa"), _mla("eager"), gqa):
        out_every, grads_every = _grads(module, x, every)
        out_only, grads_only = _grads(module, x, only)
        torch.testing.assert_close(out_only, out_every, atol=2e-5, rtol=1e-4)
        for g_only, g_every in zip(grads_only, grads_every, strict=True):
            torch.testing.assert_close(g_only, g_every, atol=2e-5, rtol=1e-4)
    # FlexAttention's tiles for the boundary rows alone (forward: it has no CPU backward)
    block = build_attention_context(ids, docs, document_mask="block", boundary_rows_R=rows)
    assert block.block_mask.kv_num_blocks.shape[0] == 2
    with torch.no_grad():
        torch.testing.assert_close(_mla("sdpa")(x, block), _mla("sdpa")(x, every), atol=2e-5, rtol=1e-4)


def test_no_boundary_row_is_plain_causal():
    ids = torch.zeros(2, 6, dtype=torch.long)
    ctx = build_attention_context(ids, torch.zeros(2, 6, dtype=torch.long), boundary_rows_R=torch.zeros(0).long())
    assert ctx.mask_B1SS is None and ctx.block_mask is None and ctx.masked_rows_R is None


def test_a_compiled_layer_masks_a_changing_count_of_boundary_rows():
    """Compiled, as the runtime's layers are: micro-batches with one and then two boundary rows (the count
    changes from step to step) give the eager layer's outputs and gradients."""
    from moetrain.data import boundary_rows

    torch._dynamo.reset()
    module = _mla("sdpa")
    compiled = torch.compile(module)
    ids = torch.zeros(3, 160, dtype=torch.long)
    for lengths in ([[60, 100], [160], [160]], [[60, 100], [160], [159, 1]], [[10, 150], [80, 80], [160]]):
        docs = _documents(lengths)
        ctx = build_attention_context(ids, docs, boundary_rows_R=boundary_rows(docs))
        x = torch.randn(3, 160, 32)
        out_eager, grads_eager = _grads(module, x, ctx)
        out_compiled, grads_compiled = _grads(compiled, x, ctx)
        torch.testing.assert_close(out_compiled, out_eager, atol=2e-5, rtol=1e-4)
        for g_compiled, g_eager in zip(grads_compiled, grads_eager, strict=True):
            torch.testing.assert_close(g_compiled, g_eager, atol=2e-5, rtol=1e-4)
