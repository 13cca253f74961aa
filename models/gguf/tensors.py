"""GGUF tensors -> the HF tensors the loader expects: llama.cpp's names mapped to HF's, and what llama.cpp's
converter (convert_hf_to_gguf.py) did to the values undone, so that each tensor equals the HF one it came
from (up to its quantization):

- Llama-arch attn_q / attn_k rows are permuted per head (ggml's rope rotates adjacent pairs, HF's rotate_half
  rotates halves): `unpermute_rope_rows` inverts `permute`. Qwen and Gemma files are not permuted (NEOX rope).
- Gemma norms are stored as 1 + w (ggml's RMSNorm multiplies by the weight; HF's Gemma by 1 + weight).

Torch-free (numpy), shared by the executor's loader (models/gguf/loader.py) and the GGUF -> HF converter.
"""
from __future__ import annotations

import numpy as np

from models.gguf.config import GEMMA
from models.gguf.file import GgufFile
from tandem.errors import CheckpointError

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 2/3 norm around attention and feed-forward both: ffn_norm is the pre-feed-forward one there.
_LAYER_GEMMA2 = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_PERMUTED_ARCHS = ("llama",)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's per-dimension rope divisors


def hf_name(name: str, arch: str) -> str:
    """The HF name of GGUF tensor `name` ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    layer_names = _LAYER_GEMMA2 if arch in ("gemma2", "gemma3") else _LAYER
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL and parts[1] in ("weight", "bias"):
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    raise CheckpointError(f"unexpected GGUF tensor {name!r} for a {arch} model")


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` (HF -> GGUF row order of q/k); the tests write files with it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_rope_rows`: each head's interleaved (x0, x1), (x2, x3) ... rows back to HF's halves
    (x_i, x_{i+d/2})."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class HfTensors:
    """The tensors of a GGUF file under their HF names, read (dequantized, un-permuted) one at a time.
    `config` is the file's HF config dict (models/gguf/config.py hf_config)."""

    def __init__(self, gguf: GgufFile, config: dict) -> None:
        self.gguf = gguf
        self.arch = gguf.metadata["general.architecture"]
        self.n_head, self.n_kv = config["num_attention_heads"], config["num_key_value_heads"]
        names: dict[str, str] = {}
        for name in gguf.tensor_shapes:
            if name == ROPE_FREQS:  # not a weight: the config's rope scaling (models/gguf/config.py)
                continue
            try:
                names[hf_name(name, self.arch)] = name
            except CheckpointError as exc:
                raise CheckpointError(f"{gguf.path}: {exc}") from None
        self.names = names  # HF name -> GGUF name

    def __contains__(self, hf: str) -> bool:
        return hf in self.names

    def shape(self, hf: str) -> tuple[int, ...]:
        return self.gguf.tensor_shapes[self.names[hf]]

    def type_of(self, hf: str) -> str:
        """The GGML type name the HF tensor `hf` is stored in ("Q4_K", "F32", ...)."""
        return self.gguf.tensor_types[self._name(hf)]

    def _name(self, hf: str) -> str:
        name = self.names.get(hf)
        if name is None:
            raise CheckpointError(f"{self.gguf.path}: missing tensor for {hf!r} (no GGUF tensor maps to it)")
        return name

    def read(self, hf: str) -> np.ndarray:
        """The HF tensor `hf` as float32 (CheckpointError naming it when the file lacks it)."""
        w = self._rows_in_hf_order(hf, self.gguf.tensor(self._name(hf)))
        if self.arch in GEMMA and hf.endswith("norm.weight"):
            w = w - np.float32(1.0)
        return w

    def read_blocks(self, hf: str) -> np.ndarray:
        """The HF matrix `hf` as stored blocks, uint8 [rows, row_bytes], rows in HF order: a view of the mapped
        file, or a copy where the rows were un-permuted (a row is whole blocks, so rows move as bytes)."""
        return self._rows_in_hf_order(hf, self.gguf.raw(self._name(hf)))

    def _rows_in_hf_order(self, hf: str, w: np.ndarray) -> np.ndarray:
        if self.arch in _PERMUTED_ARCHS and hf.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_rope_rows(w, self.n_head)
        if self.arch in _PERMUTED_ARCHS and hf.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_rope_rows(w, self.n_kv)
        return w
