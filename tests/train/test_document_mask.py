"""Where the document mask's FlexAttention tiles run: compiled CUDA layers by default, refused on a CPU
and in eager layers."""

import pytest
import torch

from moetrain.errors import UserError
from moetrain.train.trainer import resolve_document_mask


def test_document_mask_resolves_to_tiles_in_compiled_cuda_layers_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_document_mask("auto", cpu, compiled=True) == "dense"
    assert resolve_document_mask("auto", cuda, compiled=True) == "block"
    assert resolve_document_mask("auto", cuda, compiled=False) == "dense"
    assert resolve_document_mask("dense", cuda, compiled=True) == "dense"
    with pytest.raises(UserError, match="^--document-mask block runs FlexAttention, which has no backward on cpu; "
                                        "use --document-mask dense \\(or auto\\)$"):
        resolve_document_mask("block", cpu, compiled=True)
    with pytest.raises(UserError, match="^--document-mask block needs compiled layers"):
        resolve_document_mask("block", cuda, compiled=False)
