"""scripts/make_tiny_checkpoint.py: the tiny random HF checkpoints other tests compare against."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.conftest import ROOT
SCRIPT = ROOT / "scripts" / "make_tiny_checkpoint.py"
ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
EXPECTED_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}
PROMPT = "The quick brown fox jumps over the lazy dog. Hello, how are you today?"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


mtc = _load_script()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tiny")
    return {arch: mtc.make_tiny_checkpoint(arch, base / arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(built):
    """arch -> (model, tokenizer) loaded by transformers itself."""
    out = {}
    for arch, d in built.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        out[arch] = (model, transformers.AutoTokenizer.from_pretrained(d))
    return out


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_expected_config(arch, built, loaded):
    d = built[arch]
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"]:
        assert (d / name).is_file(), name
    model, tok = loaded[arch]
    cfg = model.config
    assert type(model).__name__ == EXPECTED_CLASS[arch]
    assert cfg.architectures == [EXPECTED_CLASS[arch]]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.num_hidden_layers) == (128, 256, 2)
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_parameters["rope_theta"] == 10000.0
    assert cfg.rope_parameters["rope_type"] == "default"
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)

    # Tokenizer: specials at 0/1/2, vocab padded up to a multiple of 64 with token-less ids.
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert 384 <= len(tok) <= 512
    assert cfg.vocab_size % 64 == 0 and len(tok) <= cfg.vocab_size < len(tok) + 64
    assert cfg.vocab_size > len(tok), "expected padded ids with no token"
    ids = tok(PROMPT).input_ids
    assert tok.decode(ids) == PROMPT and len(ids) < len(PROMPT.encode())  # merges learned, lossless
    assert tok("caf\u00e9 \U0001f600").input_ids  # any bytes encode (256-byte alphabet)

    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(text).input_ids
    assert chat_ids[0] == 1 and chat_ids.count(1) == 2 and chat_ids.count(2) == 1  # specials stay whole


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_tokenizer_matches_tokenizer_json(arch, built, loaded):
    # transformers 5 loads qwen2 dirs as Qwen2Tokenizer (own pre-tokenizer) and the rest as
    # TokenizersBackend; both must give the ids the raw tokenizer.json gives (what Tandem uses).
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(built[arch] / "tokenizer.json"))
    tok = loaded[arch][1]
    for text in [PROMPT, "in 2024, 100 fish\r\n\r\n  x = f(a,b);\tdon't WE'LL",
                 "cafe\u0301 \u00e9 \U0001f600 \u4f60\u597d",
                 "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"]:
        assert tok(text).input_ids == raw.encode(text).ids, text


def test_arch_specifics(built, loaded):
    # llama: tied embeddings, so no lm_head in the file.
    llama = loaded["llama"][0]
    assert llama.config.tie_word_embeddings is True
    assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in _tensors(built["llama"])
    assert llama.config.head_dim == 16

    # qwen2: untied, q/k/v biases present and nonzero.
    qwen2 = loaded["qwen2"][0]
    assert qwen2.config.tie_word_embeddings is False
    t = _tensors(built["qwen2"])
    assert "lm_head.weight" in t
    for p in ["q_proj", "k_proj", "v_proj"]:
        assert t[f"model.layers.0.self_attn.{p}.bias"].abs().min() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in t

    # qwen3 / qwen3_moe: explicit head_dim 32 != hidden/heads, with q_norm/k_norm over head_dim.
    for arch in ["qwen3", "qwen3_moe"]:
        m = loaded[arch][0]
        assert m.config.head_dim == 32 and m.config.tie_word_embeddings is False
        t = _tensors(built[arch])
        assert t["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
        assert t["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
        assert t["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
        assert not torch.allclose(t["model.layers.0.self_attn.k_norm.weight"], torch.ones(32))

    # qwen3_moe: 8 experts, top-2, normalised; saved per expert like released checkpoints.
    moe = loaded["qwen3_moe"][0]
    c = moe.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)
    assert c.norm_topk_prob is True and c.decoder_sparse_step == 1 and c.mlp_only_layers == []
    raw = json.loads((built["qwen3_moe"] / "config.json").read_text())
    assert raw["num_experts"] == 8
    t = _tensors(built["qwen3_moe"])
    assert t["model.layers.1.mlp.gate.weight"].shape == (8, 64)
    assert t["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert t["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)


def test_router_spreads_tokens(loaded):
    model, tok = loaded["qwen3_moe"]
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    for layer_logits in out.router_logits:
        chosen = {tuple(sorted(r.tolist())) for r in layer_logits.topk(2, dim=-1).indices}
        assert len(chosen) >= 5, chosen  # many different expert pairs, not one favourite


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_discriminative(arch, loaded):
    model, tok = loaded[arch]
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    assert (gap > 1e-3).float().mean() >= 0.9, gap
    assert gap.median() > 1e-2
    spread = logits.std(dim=-1)
    assert 0.5 < spread.min() and spread.max() < 10, spread


@pytest.mark.parametrize("arch", ARCHS)
def test_seed_determinism(arch, tmp_path, built):
    again = mtc.make_tiny_checkpoint(arch, tmp_path / "again", seed=0)
    for name in ["model.safetensors", "config.json", "tokenizer.json"]:
        assert (again / name).read_bytes() == (built[arch] / name).read_bytes(), name
    other = _tensors(mtc.make_tiny_checkpoint(arch, tmp_path / "other", seed=1))
    ref = _tensors(built[arch])
    assert other.keys() == ref.keys()
    assert all(not torch.equal(other[k], ref[k]) for k in ref)  # every tensor re-drawn from the seed


@pytest.mark.parametrize("kind", ["linear", "llama3", "dynamic", "yarn"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rope_scaling(kind, arch, tmp_path, loaded):
    d = mtc.make_tiny_checkpoint(arch, tmp_path / kind, rope_scaling=kind)
    raw = json.loads((d / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == kind  # transformers 5 spelling
    assert raw["rope_parameters"]["rope_theta"] == 10000.0
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    rot, base = model.model.rotary_emb, loaded[arch][0].model.rotary_emb
    assert rot.rope_type == kind
    if kind == "dynamic":
        # Dynamic NTK equals the default up to max_position_embeddings and rescales past it.
        assert torch.equal(rot.inv_freq, base.inv_freq)
        x = torch.zeros(1, 1, 64)
        rot(x, torch.arange(300)[None])
    assert not torch.allclose(rot.inv_freq, base.inv_freq)
    if kind == "linear":
        torch.testing.assert_close(rot.inv_freq, base.inv_freq / 2.0)
    if kind == "yarn":
        assert rot.attention_scaling > 1.0


def test_dtype_and_overrides(tmp_path, built):
    d = mtc.make_tiny_checkpoint("qwen2", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    ref, bf = _tensors(built["qwen2"]), _tensors(d)
    assert all(torch.equal(bf[k], ref[k].to(torch.bfloat16)) for k in ref)  # same draw, rounded

    d = mtc.make_tiny_checkpoint("qwen3_moe", tmp_path / "ov", num_layers=3,
                                 config_overrides={"num_experts": 4, "mlp_only_layers": [1]})
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert model.config.num_experts == 4 and model.config.num_hidden_layers == 3
    assert json.loads((d / "config.json").read_text())["num_experts"] == 4
    t = _tensors(d)
    assert "model.layers.1.mlp.gate_proj.weight" in t and "model.layers.2.mlp.experts.3.up_proj.weight" in t

    with pytest.raises(ValueError):
        mtc.make_tiny_checkpoint("gpt2", tmp_path / "bad")


def test_cli(tmp_path, built):
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--rope-scaling" in r.stdout
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, str(SCRIPT), "qwen3", str(out), "--seed", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # A fresh process produces the same bytes (tokenizer training and init are process-independent).
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (out / name).read_bytes() == (built["qwen3"] / name).read_bytes(), name
