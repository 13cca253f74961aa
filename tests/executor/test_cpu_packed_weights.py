"""The CPU float32 fast path (oneDNN-packed linear weights, in place of the plain ones, with the eager decode step)
gives the same logits as plain F.linear, on both sides of the row threshold, and can be turned off; with the
native decode step (which reads the plain weights) nothing is packed."""
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
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.drop_plain_weight()  # the packed weight alone serves every size, the long chunk included
    assert layer.weight.shape == (96, 64) and layer.weight.untyped_storage().nbytes() == 4
    assert rel_err(layer(x), want) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3"], ids=["tied-head", "untied-head"])
def test_executor_with_and_without_packing_agree(tiny_checkpoint, arch):
    model = tiny_checkpoint(arch)
    packed = make_executor(model, decode_kernel="torch")
    plain = make_executor(model, cpu_packed_weights=False, decode_kernel="torch")
    head = packed.model.lm_head
    tied = head.weight is packed.model.model.embed_tokens.weight
    assert tied == (arch == "llama")
    for m in packed.model.modules():  # every linear packed instead of plain, but a tied head (the embedding)
        if isinstance(m, Linear):
            assert (m.packed is not None and m.plain_dropped) == (m is not head or not tied)
    assert all(m.packed is None for m in plain.model.modules() if isinstance(m, Linear))
    prompt = [1] + list(range(5, 45))
    _, tokens_a, logits_a = greedy_run(packed, prompt, 12)
    _, tokens_b, logits_b = greedy_run(plain, prompt, 12)
    assert tokens_a == tokens_b
    for a, b in zip(logits_a, logits_b):
        assert rel_err(a, b) < 1e-5


def test_native_decode_step_leaves_weights_plain(model_dir):
    """The native step reads the plain weights: with it, packing them would hold each weight twice."""
    from models.decode.native import machine_refusal
    if machine_refusal():
        pytest.skip(machine_refusal())
    ex = make_executor(model_dir, decode_kernel="native")
    assert all(m.packed is None and not m.plain_dropped for m in ex.model.modules() if isinstance(m, Linear))
