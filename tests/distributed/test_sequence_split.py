"""The sequence-parallel split and reduce-scatter return tensors of their own, not views of a chunk.

torch 2.11's Dynamo gives a compiled ``autograd.Function`` whose forward returns a view of a chunk (or the
chunk through a no-op ``.contiguous()``) a zero gradient; torch 2.13 does not, so no gradient check here can
see it. Micro-batch 1 makes a sequence chunk contiguous. What can be checked on any torch: the output owns its
storage, and the values and gradients are the chunk's.
"""

import pytest
import torch
import torch.distributed as dist

from moetrain.distributed.comm import sp_scatter
from moetrain.distributed.tp import split_sequence


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("split", [split_sequence, lambda x, g: sp_scatter(x, g, 1)], ids=["split", "scatter"])
def test_a_micro_batch_of_one_gets_its_own_sequence_chunk(one_rank_group, split):
    x_BSD = torch.randn(1, 6, 4, requires_grad=True)
    h_BSD = x_BSD * 2.0
    out_BSD = split(h_BSD, one_rank_group)
    assert out_BSD._base is None  # not a view of the chunk (the old forward's .contiguous() kept it one)
    assert out_BSD.untyped_storage().data_ptr() != h_BSD.untyped_storage().data_ptr()
    torch.testing.assert_close(out_BSD, h_BSD, rtol=0, atol=0)
    (out_BSD * 3.0).sum().backward()
    torch.testing.assert_close(x_BSD.grad, torch.full_like(x_BSD, 6.0), rtol=0, atol=0)  # d(3·2x)/dx
