"""LoRA adapters in PEFT format: reading, validating against the base model, fusing onto our layers.

An adapter adds `scale * B @ A @ x` to some projections (q/k/v/o/gate/up/down). Our model fuses q/k/v into
one `qkv_proj`, so an adapter's q, k and v parts are fused too: A stacked along the rank axis and B
block-diagonal, giving the same three updates in one pair of matmuls. The scale is folded into B. Phi-3's
checkpoints are fused themselves, so its adapters target `qkv_proj` (our slot as is) and `gate_up_proj` (one A,
B's rows split between the gate and up slots). A vision-language model's adapters adapt its language model only
(named as transformers names it, _KEY); one on its vision encoder is refused, since the encoder's output is cached
per image and shared by every request whatever its adapter.
Applying adapters to a packed batch: models/lora/batch.py.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.config import ModelConfig
from tandem.errors import InvalidRequest

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
               "gate_up_proj")
SLOT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate",
           "up_proj": "up", "down_proj": "down", "qkv_proj": "qkv", "gate_up_proj": "gate"}
# A tensor's key is peft's: `base_model.model.` + the adapted module's name in transformers' model + `.lora_A.weight`.
# The module names of a text tower, as transformers names them: a causal LM's `model.layers.N`; a vision-language
# model's language model `model.language_model.layers.N` (Qwen2.5-VL, Gemma 3 in transformers 5; Qwen2.5-VL's own
# `model.layers.N` before), `model.text_model.layers.N` (Idefics3, SmolVLM), `language_model.model.layers.N` (Gemma 3
# before transformers 4.52). All map to our one text tower.
_KEY = re.compile(r"^(?:base_model\.model\.)?((?:model\.|model\.language_model\.|model\.text_model\.|language_model\."
                  r"model\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")
# The module names of a vision encoder and its projector/connector (Idefics3's `model.vision_model` and
# `model.connector`, Qwen2.5-VL's `model.visual`, Gemma 3's `model.vision_tower` and `model.multi_modal_projector`,
# with or without the `model.`): adapters there are refused with their own reason (see read_adapter).
_ENCODER = re.compile(r"^(?:base_model\.model\.)?((?:model\.)?(?:vision_model|visual|vision_tower|connector|"
                      r"multi_modal_projector)\..*?)\.lora_[AB]\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class LoraWeights:
    """Per (layer, slot): (A [r, in], B [out, r] with the scale folded in). Slots: qkv, o, gate, up, down."""

    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rank: int = 0  # largest rank of a single projection
    targets: tuple[str, ...] = ()  # projections adapted

    def to(self, device: torch.device) -> "LoraWeights":
        return LoraWeights({k: (a.to(device), b.to(device)) for k, (a, b) in self.pairs.items()}, self.rank,
                           self.targets)


def _out_in(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    return {"q_proj": (cfg.q_size, cfg.hidden_size), "k_proj": (cfg.kv_size, cfg.hidden_size),
            "v_proj": (cfg.kv_size, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.q_size),
            "gate_proj": (cfg.intermediate_size, cfg.hidden_size), "up_proj": (cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size),
            "qkv_proj": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),  # Phi-3's fused projections
            "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size)}[proj]


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    # PEFT's rank_pattern / alpha_pattern (peft.utils.other.get_pattern_key): the first key that matches the
    # end of the module's name; the key is a regex, grouped so that alternations apply as a whole.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _patterns(conf: dict, name: str, cfg_name: str) -> dict[str, float]:
    patterns = conf.get(name) or {}
    if not isinstance(patterns, dict):
        raise InvalidRequest(f"{cfg_name}: {name} must be an object of module pattern -> number")
    for key, value in patterns.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InvalidRequest(f"{cfg_name}: {name}[{key!r}] must be a positive number, got {value!r}")
        try:
            re.compile(key)
        except re.error as exc:
            raise InvalidRequest(f"{cfg_name}: {name} key {key!r} is not a valid regex: {exc}") from exc
    return patterns


def read_adapter(path: Path, cfg: ModelConfig, dtype: torch.dtype, max_rank: int,
                 label: str | None = None) -> LoraWeights:
    """Loads and validates a PEFT adapter directory against the base model; raises InvalidRequest naming the
    file and the problem. Returns host (CPU) tensors in dtype. label: how messages name the directory (the
    path as the client gave it; default: path), so that a server never echoes resolved host paths."""
    cfg_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    shown = str(path) if label is None else label
    cfg_name, weights_name = f"{shown}/{CONFIG_FILE}", f"{shown}/{WEIGHTS_FILE}"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise InvalidRequest(f"{shown} is not a PEFT adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        conf = json.loads(cfg_path.read_text())
    except OSError as exc:
        raise InvalidRequest(f"{cfg_name}: cannot read it: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{cfg_name}: cannot read it as JSON: {exc}") from exc
    if not isinstance(conf, dict):
        raise InvalidRequest(f"{cfg_name}: expected a JSON object, got {type(conf).__name__}")
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequest(f"{cfg_name}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, why in (("modules_to_save", "trains whole extra modules"), ("use_dora", "needs DoRA magnitudes")):
        if conf.get(key):
            raise InvalidRequest(f"{cfg_name}: {key} is set ({why}); Tandem serves plain LoRA adapters only")
    if conf.get("bias", "none") != "none":
        raise InvalidRequest(f"{cfg_name}: bias={conf['bias']!r} (trained biases) is not supported; use bias='none'")
    targets_conf = conf.get("target_modules")
    if isinstance(targets_conf, list):  # (a string is a regex over module names: checked by the tensors below)
        unknown = sorted(set(targets_conf) - set(PROJECTIONS))
        if unknown:
            tower = " of the language model (a vision encoder takes none)" if cfg.vision is not None else ""
            raise InvalidRequest(f"{cfg_name}: target_modules {unknown} are not supported; LoRA may target "
                                 f"{', '.join(PROJECTIONS)}{tower}")
    r_default = conf.get("r", 8)
    if not isinstance(r_default, int) or isinstance(r_default, bool) or r_default < 1:
        raise InvalidRequest(f"{cfg_name}: r must be a positive integer, got {r_default!r}")
    try:
        alpha = float(conf.get("lora_alpha", 8))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{cfg_name}: lora_alpha must be a number, got {conf.get('lora_alpha')!r}") from exc
    rslora = bool(conf.get("use_rslora", False))
    rank_pattern, alpha_pattern = _patterns(conf, "rank_pattern", cfg_name), _patterns(conf, "alpha_pattern", cfg_name)
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}  # the module's name in transformers' model (rank/alpha patterns match it)
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                encoder = _ENCODER.match(key)
                if encoder is not None:
                    raise InvalidRequest(f"{weights_name}: tensor {key!r} adapts {encoder.group(1)!r}, a module of the "
                                         "vision encoder; adapters on the vision encoder (or its projector) are not "
                                         "supported, since an image's encoder output is cached by its content and "
                                         "shared by every adapter: restrict target_modules to the language model, "
                                         "e.g. r'.*(language_model|text_model).*\\.(q_proj|v_proj)'")
                if ".mlp.experts." in key or ".mlp.gate." in key:
                    raise InvalidRequest(f"{weights_name}: tensor {key!r} adapts a mixture-of-experts layer (its "
                                         "experts or router); LoRA on experts is not supported: adapt the "
                                         "attention projections only")
                m = _KEY.match(key)
                if m is None or m.group(4) not in PROJECTIONS:
                    raise InvalidRequest(f"{weights_name}: tensor {key!r} is not a LoRA A/B weight of "
                                         f"{'/'.join(PROJECTIONS)} (embedding or LM-head adapters are not supported)")
                layer, proj = int(m.group(2)), m.group(4)
                if modules.setdefault((layer, proj), m.group(1)) != m.group(1):
                    raise InvalidRequest(f"{weights_name}: layer {layer} {proj} is adapted twice, as "
                                         f"{modules[(layer, proj)]!r} and {m.group(1)!r}")
                raw.setdefault((layer, proj), {})[m.group(5)] = f.get_tensor(key)
    except OSError as exc:  # its str() names the resolved file
        raise InvalidRequest(f"{weights_name}: cannot read it: {exc.strerror}") from exc
    except SafetensorError as exc:
        raise InvalidRequest(f"{weights_name}: cannot read it as safetensors: {exc}") from exc
    if not raw:
        raise InvalidRequest(f"{weights_name}: holds no LoRA weights")
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, proj), ab in sorted(raw.items()):
        where = f"{weights_name}: layer {layer} {proj}"
        if layer >= cfg.num_layers:
            raise InvalidRequest(f"{where}: the base model has only {cfg.num_layers} layers")
        if cfg.is_moe_layer(layer) and SLOT_OF[proj] in ("gate", "up", "down"):
            raise InvalidRequest(f"{where}: layer {layer} is a mixture-of-experts layer; LoRA on its experts is not "
                                 "supported (adapt the attention projections only)")
        if set(ab) != {"A", "B"}:
            raise InvalidRequest(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        out_f, in_f = _out_in(cfg, proj)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, a.shape[0]):
            raise InvalidRequest(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                                 f"model (expected [r, {in_f}] / [{out_f}, r]): an adapter for another model?")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InvalidRequest(f"{where}: the weights hold NaN or infinity")
        r = a.shape[0]
        if r > max_rank:
            raise InvalidRequest(f"{where}: rank {r} exceeds this executor's --max-lora-rank {max_rank}")
        module = modules[(layer, proj)]
        r_conf = _pattern_value(rank_pattern, module, r_default)
        if r_conf != r:  # peft refuses such a file too (size mismatch): the scale would be wrong
            raise InvalidRequest(f"{where}: adapter_config.json gives rank {r_conf} but the tensors have rank {r}")
        a_conf = _pattern_value(alpha_pattern, module, alpha)
        scale = a_conf / (math.sqrt(r) if rslora else r)
        b_scaled = (b.float() * scale).to(dtype)
        if not torch.isfinite(b_scaled).all():
            raise InvalidRequest(f"{where}: lora_B x scale ({scale:g}) overflows {dtype}")
        scaled[(layer, proj)] = (a.to(dtype), b_scaled)
        rank = max(rank, r)
    targets = tuple(p for p in PROJECTIONS if any(k[1] == p for k in scaled))
    return LoraWeights(_fuse(scaled, cfg), rank, targets)


def _fuse(pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], cfg: ModelConfig
          ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Maps projections onto the model's layers: q/k/v into one qkv pair (A stacked, B block-diagonal)."""
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in sorted({k[0] for k in pairs}):
        parts = [(p, pairs.get((layer, p))) for p in ("q_proj", "k_proj", "v_proj")]
        if any(ab is not None for _, ab in parts):
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
            ranks = [ab[0].shape[0] if ab is not None else 0 for _, ab in parts]
            dtype = next(ab[0].dtype for _, ab in parts if ab is not None)
            a = torch.zeros(sum(ranks), cfg.hidden_size, dtype=dtype)  # [r_q + r_k + r_v, hidden]
            b = torch.zeros(sum(sizes), sum(ranks), dtype=dtype)  # [q + 2 kv, r_q + r_k + r_v]
            r0 = o0 = 0
            for (_, ab), r, n in zip(parts, ranks, sizes):
                if ab is not None:
                    a[r0:r0 + r] = ab[0]
                    b[o0:o0 + n, r0:r0 + r] = ab[1]
                r0, o0 = r0 + r, o0 + n
            out[(layer, "qkv")] = (a, b)
        if (layer, "qkv_proj") in pairs:
            out[(layer, "qkv")] = pairs[(layer, "qkv_proj")]
        if (layer, "gate_up_proj") in pairs:  # B [2I, r]: gate rows, then up rows
            a, b = pairs[(layer, "gate_up_proj")]
            out[(layer, "gate")], out[(layer, "up")] = (a, b[:cfg.intermediate_size]), (a, b[cfg.intermediate_size:])
        for proj in ("o_proj", "gate_proj", "up_proj", "down_proj"):
            if (layer, proj) in pairs:
                out[(layer, SLOT_OF[proj])] = pairs[(layer, proj)]
    return out
