"""Checkpoints quantized by AWQ, GPTQ and compressed-tensors (models/quant/prequantized.py, packed_int4.py):
known integer weights packed as each library packs them unpack to the same values, map onto blocks that hold
them (exactly, or up to float16 rounding of Q4_1's minimum), load into BlockWeights, and run; what does not
map is refused by name."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import load_model
from models.quant.block_formats import dequantize_reference
from models.quant.packed_int4 import as_symmetric, to_blocks, unpack_awq, unpack_compressed, unpack_gptq
from models.quant.linear import Int8Weight
from models.quant.prequantized import read_scheme
from tandem.errors import CheckpointError
from tests.executor_driver import greedy_run, make_executor, teacher_forced_logits
from tests.hf_reference import rel_err
from tests.prequantized_files import (StandInBlockWeight, known_weights, pack_awq, pack_compressed, pack_gptq,
                                      write_prequantized)

OUT, IN, GROUP = 48, 128, 32

AWQ = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True}
CT_GROUP = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                            "strategy": "group", "group_size": GROUP}}}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": CT_GROUP,
      "ignore": ["lm_head"]}


def _ct(fmt: str = "pack-quantized", **weights) -> dict:
    group = {"targets": ["Linear"], "weights": {**CT_GROUP["group_0"]["weights"], **weights}}
    return {**CT, "format": fmt, "config_groups": {"group_0": group}}


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr("models.quant.prequantized.BlockWeight", StandInBlockWeight)


# name -> (bits, symmetric, unpack(known) -> Unpacked, the block format)
SCHEMES = {
    "awq": (4, False, lambda k: unpack_awq("l", **pack_awq(k), group=GROUP, out_features=OUT, in_features=IN), "Q4_1"),
    "gptq-v1-sym": (4, True, lambda k: as_symmetric("l", unpack_gptq("l", **pack_gptq(k, 4, v1=True), bits=4,
                    group=GROUP, zero_offset=1, out_features=OUT, in_features=IN)), "Q4_0"),
    "gptq-v1-asym": (4, False, lambda k: unpack_gptq("l", **pack_gptq(k, 4, v1=True), bits=4, group=GROUP,
                     zero_offset=1, out_features=OUT, in_features=IN), "Q4_1"),
    "gptq-v2-asym": (4, False, lambda k: unpack_gptq("l", **pack_gptq(k, 4, v1=False), bits=4, group=GROUP,
                     zero_offset=0, out_features=OUT, in_features=IN), "Q4_1"),
    "gptq-8bit-sym": (8, True, lambda k: as_symmetric("l", unpack_gptq("l", **pack_gptq(k, 8, v1=True), bits=8,
                      group=GROUP, zero_offset=1, out_features=OUT, in_features=IN)), "Q8_0"),
    "ct-packed-sym": (4, True, lambda k: _unpack_ct(k, 4, True), "Q4_0"),
    "ct-packed-asym": (4, False, lambda k: _unpack_ct(k, 4, True), "Q4_1"),
    "ct-int4-sym": (4, True, lambda k: _unpack_ct(k, 4, False), "Q4_0"),
    "ct-int8-sym": (8, True, lambda k: _unpack_ct(k, 8, False), "Q8_0"),
}


def _unpack_ct(k, bits: int, packed: bool):
    t = pack_compressed(k, bits, packed)
    weight = t["weight_packed"] if packed else t["weight"]
    return unpack_compressed("l", weight, t["weight_scale"], t.get("weight_zero_point"), bits, GROUP, packed, OUT, IN)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_unpacked_weights_and_blocks_hold_the_known_values(scheme):
    bits, symmetric, unpack, fmt_name = SCHEMES[scheme]
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))
    known = known_weights(w, bits, GROUP, symmetric)
    unpacked = unpack(known)
    assert torch.equal(unpacked.codes.long(), torch.from_numpy(known.codes))
    assert torch.equal(unpacked.dequantize(), known.dequantized())
    fmt, blocks = to_blocks("l", unpacked)
    assert fmt.name == fmt_name and tuple(blocks.shape) == (OUT, fmt.row_bytes(IN))
    back = torch.from_numpy(dequantize_reference(blocks.numpy(), fmt, IN))
    if fmt_name == "Q4_1":  # m = -scale * zero, rounded once to float16
        bound = float((torch.from_numpy(known.scales.astype(np.float32)) * torch.from_numpy(known.zeros)).abs().max())
        assert float((back - known.dequantized()).abs().max()) <= bound * 2 ** -11
    else:
        assert torch.equal(back, known.dequantized())  # exact: float16 scales, the codes as stored


@pytest.mark.parametrize("config, match", [
    ({**AWQ, "bits": 3}, "bits=3: only 4-bit AWQ"),
    ({**AWQ, "version": "gemv"}, "version='gemv': only AutoAWQ's 'gemm'"),
    ({**AWQ, "zero_point": False}, "zero_point=false"),
    ({**AWQ, "group_size": 48}, "group_size 48 is not a multiple of 32"),
    ({**GPTQ, "desc_act": True}, r"desc_act=true \(act-order\)"),
    ({**GPTQ, "bits": 2}, "bits=2: 4- and 8-bit GPTQ"),
    ({**GPTQ, "bits": 8, "sym": False}, "bits=8 with sym=false"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**GPTQ, "group_size": 16}, "group_size 16 is not a multiple of 32"),
    (_ct("float-quantized"), "format='float-quantized'"),
    (_ct(type="float", num_bits=8), "weights of type 'float'"),
    (_ct(strategy="tensor"), "strategy='tensor'"),
    (_ct(actorder="group"), "actorder='group'"),
    (_ct(num_bits=8, symmetric=False), "8-bit weights with zero points"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not loaded"),
])
def test_schemes_that_do_not_map_are_refused_by_name(config, match):
    with pytest.raises(CheckpointError, match=match):
        read_scheme(config, "config.json")


def test_schemes_that_map_are_read():
    assert read_scheme(AWQ, "c").group == GROUP and not read_scheme(AWQ, "c").symmetric
    gptq = read_scheme({**GPTQ, "group_size": -1}, "c")
    assert gptq.group is None and gptq.symmetric and gptq.zero_offset == 1  # channel-wise, v1 zeros
    assert read_scheme({**GPTQ, "checkpoint_format": "gptq_v2"}, "c").zero_offset == 0
    assert read_scheme(_ct("int-quantized", num_bits=8, strategy="channel"), "c").packed is False


def test_act_order_g_idx_is_refused():
    k = known_weights(torch.randn(OUT, IN), 4, GROUP, True)
    t = pack_gptq(k, 4, v1=True)
    t["g_idx"] = t["g_idx"].flip(0)
    with pytest.raises(CheckpointError, match=r"l.g_idx reorders the inputs' groups \(act-order\)"):
        unpack_gptq("l", **t, bits=4, group=GROUP, zero_offset=1, out_features=OUT, in_features=IN)


LOADS = {
    "awq": (AWQ, pack_awq, 4, False),
    "gptq-v1-sym": (GPTQ, lambda k: pack_gptq(k, 4, v1=True), 4, True),
    "gptq-8bit": ({**GPTQ, "bits": 8}, lambda k: pack_gptq(k, 8, v1=True), 8, True),
    "ct-packed-asym": (_ct(symmetric=False), lambda k: pack_compressed(k, 4, True), 4, False),
    "ct-int8-channel": (_ct("int-quantized", num_bits=8, strategy="channel", group_size=None),
                        lambda k: pack_compressed(k, 8, False), 8, True),
    # (older compressed-tensors store all-zero zero points for symmetric schemes too)
    "ct-int4-zeros-stored": (_ct("int-quantized"), lambda k: {**pack_compressed(k, 4, False),
                             "weight_zero_point": torch.zeros(k.scales.shape, dtype=torch.int8)}, 4, True),
}


@pytest.mark.parametrize("scheme", LOADS)
def test_checkpoints_load_as_blocks_of_the_known_weights(scheme, tiny_checkpoint, tmp_path, stand_in):
    """Qwen2 (q/k/v biases: the fused q/k/v matrix is three layers' blocks with one bias), every decoder layer
    quantized, the LM head left float."""
    config, pack, bits, symmetric = LOADS[scheme]
    group = None if "channel" in scheme else GROUP
    known = write_prequantized(tiny_checkpoint("qwen2"), tmp_path / "m", config, pack, bits, group, symmetric)
    model = load_model(tmp_path / "m", progress=False)
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj.quant, StandInBlockWeight)
    assert layer.self_attn.qkv_proj.weight.numel() == 0 and layer.self_attn.qkv_proj.quant.bias is not None
    assert model.lm_head.quant is None  # left float, as the schemes leave it
    base = "model.layers.1."
    want = {"self_attn.qkv_proj": torch.cat([known[f"{base}self_attn.{p}_proj.weight"] for p in "qkv"]),
            "mlp.down_proj": known[f"{base}mlp.down_proj.weight"]}
    for name, w in want.items():
        got = layer.get_submodule(name).quant.weight
        # symmetric: exact; Q4_1's m rounds to float16 (2^-11 of scale * zero, each below the max weight x 15)
        assert float((got - w).abs().max()) <= (0 if symmetric else 2e-3 * float(w.abs().max())), name
    model.quantize("int8", force_dequant=True)  # --quantization: the float layers only (here the LM head)
    assert isinstance(model.lm_head.quant, Int8Weight) and isinstance(layer.mlp.down_proj.quant, StandInBlockWeight)


def test_a_prequantized_executor_computes_with_the_known_weights(tiny_checkpoint, tmp_path, stand_in):
    """GPTQ (symmetric: Q4_0, exact) against a float checkpoint holding the known dequantized weights."""
    src = tiny_checkpoint("qwen2")
    known = write_prequantized(src, tmp_path / "q", GPTQ, lambda k: pack_gptq(k, 4, v1=True), 4, GROUP, True)
    shutil.copytree(src, tmp_path / "f")
    state = load_file(str(src / "model.safetensors"))
    state.update(known)
    save_file(state, str(tmp_path / "f" / "model.safetensors"), metadata={"format": "pt"})
    ref = make_executor(tmp_path / "f", decode_kernel="torch", cpu_packed_weights=False)
    ex = make_executor(tmp_path / "q", decode_kernel="torch")
    prompt = [1] + list(range(5, 30))
    _, tokens, logits_ref = greedy_run(ref, prompt, 5)
    errors = [rel_err(a, b) for a, b in zip(teacher_forced_logits(ex, prompt, tokens), logits_ref)]
    assert max(errors) < 1e-5, errors


def test_off_cpus_a_prequantized_checkpoint_is_refused():
    from models.quant.prequantized import PrequantizedLinears
    with pytest.raises(CheckpointError, match="awq checkpoint runs on the block kernels, which run on CPUs; this "
                                              "executor's device is cuda"):
        PrequantizedLinears(read_scheme(AWQ, "c"), "m", [], {}, torch.float32, torch.device("cuda"))


def test_a_symmetric_scheme_with_other_zero_points_is_refused(tiny_checkpoint, tmp_path, stand_in):
    pack = lambda k: {**pack_compressed(k, 4, False),  # noqa: E731
                      "weight_zero_point": torch.ones(k.scales.shape, dtype=torch.int8)}
    write_prequantized(tiny_checkpoint("llama"), tmp_path / "m", _ct("int-quantized"), pack, 4, GROUP, True)
    with pytest.raises(CheckpointError, match="q_proj: the config says symmetric but zero points other than 8"):
        load_model(tmp_path / "m", progress=False)
