"""transformers references on the same weights: the model's forward over a DynamicCache, and greedy `generate`
of an exact number of tokens, batched or one prompt at a time, as request records."""
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
    """One `generate` over a [B, L] batch of one length (no padding); (new ids per prompt, start, end)."""
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    end = time.perf_counter()
    return out[:, input_ids.shape[1]:].tolist(), start, end


class HfForward:
    """transformers' bare forward with its DynamicCache (sdpa attention), greedy: the argmax of the last position,
    copied to the host as Tandem's caller gets its tokens. Each call returns (wall, cpu) seconds."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.model = load_causal_lm(model_dir, dtype, device, attn_implementation="sdpa")
        self.device = device
        self.cache: Any = None
        self.next_ids: torch.Tensor | None = None

    @torch.inference_mode()
    def prefill(self, prompts: torch.Tensor, logits_to_keep: int = 0, keep: bool = False) -> tuple[float, float]:
        """One forward of [B, L] with a fresh cache; keep: decode from it afterwards."""
        from transformers import DynamicCache
        cache = DynamicCache(config=self.model.config)
        clock = Clock(self.device)
        with clock:
            out = self.model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
            next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            next_ids.tolist()  # the host sees the tokens, as Tandem's caller does
        if keep:
            self.cache, self.next_ids = cache, next_ids
        return clock.times[0], clock.cpu_times[0]

    @torch.inference_mode()
    def decode_step(self) -> tuple[float, float]:
        clock = Clock(self.device)
        with clock:
            out = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)
            self.next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            self.next_ids.tolist()
        return clock.times[0], clock.cpu_times[0]

    def release(self) -> None:
        self.cache, self.next_ids = None, None


class HfBaseline:
    """Serving baselines: greedy `generate` of exactly the requested tokens (EOS neither stops nor is masked,
    like Tandem's ignore_eos), batch after batch (batch size 1: one request at a time, as a naive server)."""

    def __init__(self, model_dir: Path, pad_id: int, log: Callable[[str], None]) -> None:
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        class StepTimes(BaseStreamer):  # when each step's tokens exist (the first put() is the prompt)
            def __init__(self) -> None:
                self.times: list[float] = []
                self.calls = 0

            def put(self, value: torch.Tensor) -> None:
                self.calls += 1
                if self.calls > 1:
                    self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        t = time.perf_counter()
        self.model = load_causal_lm(model_dir)
        self.streamer_cls, self.config_cls, self.pad_id, self.log = StepTimes, GenerationConfig, pad_id, log
        log(f"transformers model loaded in {time.perf_counter() - t:.1f}s")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float], float, float]:
        """One batched greedy generate; (new ids per prompt, step times, start, end)."""
        gc = self.config_cls(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=self.pad_id)
        streamer = self.streamer_cls()
        new, start, end = generate_greedy(self.model, torch.tensor(prompts, dtype=torch.long), generation_config=gc,
                                          streamer=streamer)
        return new, streamer.times, start, end

    def run(self, name: str, prompts: list[list[int]], batch_size: int, output_len: int, warmup: bool
            ) -> list[Record]:
        """The prompts in batches, one after the other; a record per prompt (all of a batch share its times)."""
        if warmup:
            self.generate(prompts[:batch_size], min(4, output_len))
        records: list[Record] = []
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b:b + batch_size]
            new, steps, start, end = self.generate(batch, output_len)
            for j, (p, ids) in enumerate(zip(batch, new)):
                records.append(Record(b + j, len(p), start=start, end=end, output_ids=ids,
                                      messages=[(t, 1) for t in steps], finish_reason="length",
                                      usage={"completion_tokens": len(ids)}))
            self.log(f"{name}: {b + len(batch)}/{len(prompts)} prompts, last batch {end - start:.2f}s")
        return records
