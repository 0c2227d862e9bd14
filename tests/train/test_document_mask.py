"""Where the document mask's FlexAttention tiles run: CUDA by default, refused on a CPU."""

import pytest
import torch

from moetrain.errors import UserError
from moetrain.train.trainer import resolve_document_mask


def test_document_mask_resolves_to_tiles_on_cuda_and_dense_on_cpu():
    assert resolve_document_mask("auto", torch.device("cpu")) == "dense"
    assert resolve_document_mask("auto", torch.device("cuda", 0)) == "block"
    assert resolve_document_mask("dense", torch.device("cuda", 0)) == "dense"
    with pytest.raises(UserError, match="^--document-mask block runs FlexAttention, which has no backward on cpu; "
                                        "use --document-mask dense \\(or auto\\)$"):
        resolve_document_mask("block", torch.device("cpu"))
