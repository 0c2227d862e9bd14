import pytest
import torch
from hf_reference import VOCAB


@pytest.fixture
def random_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))
