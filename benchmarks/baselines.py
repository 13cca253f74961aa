"""transformers references on the same weights: the model's forward over a DynamicCache, and greedy
`generate` of an exact number of tokens, batched or one prompt at a time, as request records."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.measure import Clock
from benchmarks.request_metrics import Record


def load_causal_lm(model_dir: Path, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                   **kwargs: Any) -> Any:
    """AutoModelForCausalLM in eval mode; kwargs go to from_pretrained (e.g. attn_implementation)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return (model if device is None else model.to(device)).eval()


@torch.inference_mode()
def generate_greedy(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> tuple[list[list[int]], float, float]:
    """One `generate` call over a [B, L] batch of one length (no padding, all-ones attention mask); returns
    (new ids per prompt, start, end) on the perf_counter clock. kwargs: generate's (sampling, lengths,
    streamer)."""
    mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
    end = time.perf_counter()
    return out[:, input_ids.shape[1]:].tolist(), start, end


class HfForward:
    """transformers' bare forward with its DynamicCache (sdpa attention), greedy: argmax of the last position,
    copied to the host as Tandem's caller gets its tokens. Each call returns (wall, cpu) seconds."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.model = load_causal_lm(model_dir, dtype, device, attn_implementation="sdpa")
        self.device = device
        self.cache = None
        self.next_ids: torch.Tensor | None = None

    def _new_cache(self) -> Any:
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    @torch.inference_mode()
    def prefill(self, prompts: torch.Tensor, logits_to_keep: int = 0, keep: bool = False) -> tuple[float, float]:
        """One forward of [B, L] with a fresh cache, then argmax of the last position; keep: decode from it."""
        cache = self._new_cache()
        clock = Clock(self.device)
        with clock:
            out = self.model(input_ids=prompts, past_key_values=cache, use_cache=True,
                             logits_to_keep=logits_to_keep)
            next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
            next_ids.tolist()  # the host sees the tokens, as Tandem's caller does
        del out
        if keep:
            self.cache, self.next_ids = cache, next_ids
        return clock.times[0], clock.cpu_times[0]

    @torch.inference_mode()
    def decode_step(self) -> tuple[float, float]:
        clock = Clock(self.device)
        with clock:
            out = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)
            self.next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
            self.next_ids.tolist()
        return clock.times[0], clock.cpu_times[0]

    def release(self) -> None:
        self.cache, self.next_ids = None, None


def step_timer() -> Any:
    """A transformers streamer that records when each generation step's tokens exist (generate's first
    put() is the prompt, not a step)."""
    from transformers.generation.streamers import BaseStreamer

    class StepTimes(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self._prompt_seen:
                self._prompt_seen = True
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return StepTimes()


class HfBaseline:
    """Serving baselines: greedy `generate` of exactly the requested tokens, EOS ignored, batch after batch
    (batch size 1: one request at a time, as a naive server would)."""

    def __init__(self, model_dir: Path, pad_id: int, log: Callable[[str], None]) -> None:
        from transformers import GenerationConfig
        t = time.perf_counter()
        self.model = load_causal_lm(model_dir)
        self._config_cls = GenerationConfig
        self.pad_id = pad_id
        self.log = log
        log(f"transformers model loaded in {time.perf_counter() - t:.1f}s "
            f"(attention: {getattr(self.model.config, '_attn_implementation', '?')})")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float], float, float]:
        """One batched greedy generate; returns (new ids per prompt, step times, start, end)."""
        ids = torch.tensor(prompts, dtype=torch.long)
        # eos_token_id [] (not None, which falls back to generation_config.json): EOS neither stops
        # generation nor is masked, like Tandem's ignore_eos.
        gc = self._config_cls(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
                              pad_token_id=self.pad_id, use_cache=True)
        streamer = step_timer()
        new, start, end = generate_greedy(self.model, ids, generation_config=gc, streamer=streamer)
        return new, streamer.times, start, end

    def run(self, name: str, prompts: list[list[int]], batch_size: int, output_len: int,
            warmup: bool) -> tuple[list[Record], float, float]:
        """Runs the prompts in batches, one after the other; returns (records, t0, measured duration)."""
        if warmup:
            self.generate(prompts[:batch_size], min(4, output_len))
        records: list[Record] = []
        t0 = time.perf_counter()
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b:b + batch_size]
            new, steps, start, end = self.generate(batch, output_len)
            for j, (p, ids) in enumerate(zip(batch, new)):
                rec = Record(b + j, len(p), start=start, end=end, output_ids=ids,
                             messages=[(t, 1) for t in steps], finish_reason="FINISH_REASON_LENGTH")
                if len(ids) != output_len or len(steps) != output_len:
                    rec.finish_reason = f"{len(ids)} ids, {len(steps)} steps"
                records.append(rec)
            self.log(f"{name}: {min(b + batch_size, len(prompts))}/{len(prompts)} prompts, last batch "
                     f"{end - start:.2f}s")
        return records, t0, time.perf_counter() - t0
