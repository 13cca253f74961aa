"""The quantized benchmark's quality part: the shipped SmolLM2-135M Q4_1 GGUF served by Tandem (an in-process
Executor on the file) against transformers on the same weights dequantized (the HF directory
scripts/prepare_default_model.py converts the file into). Teacher-forced on transformers' greedy continuations of
the four chat prompts of benchmarks/quality.py: the largest logit difference and top-1 agreement per position;
and Tandem's own greedy tokens against transformers' (leading tokens equal, per prompt)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.cli import model_dir, prepare_script
from benchmarks.local_executor import build_executor
from benchmarks.quality import QUESTIONS, chat_prompt, greedy_tokens, leading_agreement, teacher_forced_logits


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `prompt` and its logits [steps, vocab] before each token."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat(out.logits).float()


def quality_part(steps: int, threads: int, log: Callable[[str], None]) -> dict[str, Any]:
    import transformers
    from tokenizers import Tokenizer
    source = prepare_script().find_gguf()
    reference_dir = model_dir(None)  # the same file, dequantized to float32 (an HF directory)
    tok = Tokenizer.from_file(str(reference_dir / "tokenizer.json"))
    encoded = [tok.encode(chat_prompt(q), add_special_tokens=False).ids for q in QUESTIONS]
    model = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # past EOS, as Tandem's decode calls go (min_new_tokens would mask it)
    reference = [hf_greedy(model, p, steps) for p in encoded]
    del model
    longest = max(map(len, encoded)) + steps + 16
    ex = build_executor(source, "cpu", "float32", kv_blocks=4 * (longest // 16 + 2), max_batch_tokens=4096)
    max_diff, top1, greedy_equal = 0.0, 0, []
    for prompt, (tokens, hf_logits) in zip(encoded, reference):
        ours = teacher_forced_logits(ex, prompt, tokens)  # [steps, vocab]
        max_diff = max(max_diff, float((ours - hf_logits).abs().max()))
        top1 += int((ours.argmax(-1) == hf_logits.argmax(-1)).sum())
        greedy_equal.append(leading_agreement(greedy_tokens(ex, prompt, steps), tokens))
    out = {"file": source.name, "reference": str(reference_dir), "positions": steps * len(encoded),
           "max_abs_diff": max_diff, "top1_agree": top1, "greedy_equal": greedy_equal,
           "greedy_total": steps * len(encoded), "threads": threads}
    log(f"quality: max |logit diff| {max_diff:.4g}, top-1 {top1}/{out['positions']}, greedy {greedy_equal}")
    return out
