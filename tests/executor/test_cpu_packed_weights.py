"""The CPU float32 fast path (oneDNN-packed linear weights for calls of <= PACKED_MAX_TOKENS rows) gives the
same logits as plain F.linear, on both sides of the row threshold, and can be turned off."""
from __future__ import annotations

import pytest
import torch

from models import transformer
from models.transformer import Linear
from tests.executor_driver import greedy_run, make_executor
from tests.hf_reference import rel_err

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without mkldnn")


@torch.no_grad()
def test_packed_linear_matches_f_linear():
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True)
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    x = torch.randn(transformer.PACKED_MAX_TOKENS + 8, 64)
    for rows in (1, 7, transformer.PACKED_MAX_TOKENS, transformer.PACKED_MAX_TOKENS + 8):  # both paths
        got = layer(x[:rows])
        want = torch.nn.functional.linear(x[:rows], layer.weight, layer.bias)
        assert rel_err(got, want) < 1e-5


def test_executor_with_and_without_packing_agree(tiny_checkpoint):
    model = tiny_checkpoint("llama")
    packed, plain = make_executor(model), make_executor(model, cpu_packed_weights=False)
    assert all(m.packed is not None for m in packed.model.modules() if isinstance(m, Linear))
    assert all(m.packed is None for m in plain.model.modules() if isinstance(m, Linear))
    prompt = [1] + list(range(5, 45))
    _, tokens_a, logits_a = greedy_run(packed, prompt, 12)
    _, tokens_b, logits_b = greedy_run(plain, prompt, 12)
    assert tokens_a == tokens_b
    for a, b in zip(logits_a, logits_b):
        assert rel_err(a, b) < 1e-5
