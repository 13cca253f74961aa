"""LoRA adapters in PEFT format, and their batched application inside one packed forward.

An adapter adds `scale * B @ A @ x` to some projections (q/k/v/o/gate/up/down). Our model fuses q/k/v into
one `qkv_proj`, so an adapter's q, k and v parts are fused too: A stacked along the rank axis and B
block-diagonal, giving the same three updates in one pair of matmuls. The scale is folded into B.

In a batch that mixes adapters, every linear layer first runs its base projection once over all tokens,
then, per adapter present, adds the low-rank update to that adapter's tokens only (a gather, two skinny
matmuls, a scatter-add) — Punica's segmented idea (SGMV) in plain torch: one small matmul pair per
adapter per layer, never a forward per adapter or per item. Ranks may differ between adapters.
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
from models.errors import InvalidRequest

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SLOT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate",
           "up_proj": "up", "down_proj": "down"}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
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
            "down_proj": (cfg.hidden_size, cfg.intermediate_size)}[proj]


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    # PEFT's rank_pattern / alpha_pattern: the first key that matches the end of the module's name.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_adapter(path: Path, cfg: ModelConfig, dtype: torch.dtype, max_rank: int) -> LoraWeights:
    """Loads and validates a PEFT adapter directory against the base model; raises InvalidRequest naming the
    file and the problem. Returns host (CPU) tensors in dtype."""
    cfg_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_path.is_file() or not weights_path.is_file():
        raise InvalidRequest(f"{path} is not a PEFT adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        conf = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{cfg_path}: cannot read it as JSON: {exc}") from exc
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequest(f"{cfg_path}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, why in (("modules_to_save", "trains whole extra modules"), ("use_dora", "needs DoRA magnitudes")):
        if conf.get(key):
            raise InvalidRequest(f"{cfg_path}: {key} is set ({why}); Tandem serves plain LoRA adapters only")
    if conf.get("bias", "none") != "none":
        raise InvalidRequest(f"{cfg_path}: bias={conf['bias']!r} (trained biases) is not supported; use bias='none'")
    alpha = float(conf.get("lora_alpha", 8))
    rslora = bool(conf.get("use_rslora", False))
    rank_pattern, alpha_pattern = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None or m.group(3) not in PROJECTIONS:
                    raise InvalidRequest(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight of "
                                         f"{'/'.join(PROJECTIONS)} (embedding or LM-head adapters are not supported)")
                raw.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = f.get_tensor(key)
    except (SafetensorError, OSError) as exc:
        raise InvalidRequest(f"{weights_path}: cannot read it as safetensors: {exc}") from exc
    if not raw:
        raise InvalidRequest(f"{weights_path}: holds no LoRA weights")
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, proj), ab in sorted(raw.items()):
        where = f"{weights_path}: layer {layer} {proj}"
        if layer >= cfg.num_layers:
            raise InvalidRequest(f"{where}: the base model has only {cfg.num_layers} layers")
        if set(ab) != {"A", "B"}:
            raise InvalidRequest(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        out_f, in_f = _out_in(cfg, proj)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
            raise InvalidRequest(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                                 f"model (expected [r, {in_f}] / [{out_f}, r]): an adapter for another model?")
        if r > max_rank:
            raise InvalidRequest(f"{where}: rank {r} exceeds this executor's --max-lora-rank {max_rank}")
        module = f"model.layers.{layer}.{'self_attn' if SLOT_OF[proj] in ('qkv', 'o') else 'mlp'}.{proj}"
        r_conf = _pattern_value(rank_pattern, module, r)
        a_conf = _pattern_value(alpha_pattern, module, alpha)
        scale = a_conf / (math.sqrt(r_conf) if rslora else r_conf)
        scaled[(layer, proj)] = (a.to(dtype), (b.float() * scale).to(dtype))
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
        for proj in ("o_proj", "gate_proj", "up_proj", "down_proj"):
            if (layer, proj) in pairs:
                out[(layer, SLOT_OF[proj])] = pairs[(layer, proj)]
    return out


class LoraBatch:
    """Which tokens of a packed batch use which adapter, for one forward. rows: a slice when the adapter's
    tokens are contiguous in the batch (the usual case: items grouped), else an index tensor [n]."""

    def __init__(self, segments: list[tuple[LoraWeights, slice | torch.Tensor]]) -> None:
        self.segments = segments

    @classmethod
    def build(cls, spans: dict[str, list[tuple[int, int]]], weights: dict[str, LoraWeights],
              device: torch.device) -> "LoraBatch | None":
        """spans: adapter name -> [(start, stop)) token ranges in the packed batch (base tokens absent)."""
        segments = []
        for name, ranges in spans.items():
            ranges.sort()
            contiguous = all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:]))
            if contiguous:
                rows: slice | torch.Tensor = slice(ranges[0][0], ranges[-1][1])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)
            segments.append((weights[name], rows))
        return cls(segments) if segments else None

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, slot: str) -> torch.Tensor:
        """Adds each adapter's update to its tokens' rows of y in place. y: [T, out]; x: [T, in]."""
        for w, rows in self.segments:
            ab = w.pairs.get((layer, slot))
            if ab is None:
                continue
            a, b = ab
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.T) @ b.T  # [n, in] @ [in, r] @ [r, out]
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y
