"""Gemma 3 images in, text out through real processes (issue 48): a tiny random Gemma3ForConditionalGeneration
served by an executor and a scheduler whose prefill chunk (3) is shorter than an image's span (4 tokens that
attend to each other both ways), against transformers on the same image and text — through the OpenAI chat route
with the image as a base64 data URL sent by the `openai` package. The chunks run through the span whole; a
repeated image hits the executor's embedding cache and its prefix cache."""
from __future__ import annotations

import base64

import openai
import pytest
import torch

from tandem.executor.v1 import executor_pb2 as epb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.vision_checkpoints import GEMMA3_MM_TOKENS, gemma3_checkpoint, noise_image, png_bytes

TEXT = "Describe the fish."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return gemma3_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(request, ckpt):
    executor = start_for(request, ckpt, "--kv-blocks", "128")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0", "--prefill-chunk", "3",
                                    "--served-model-name", "m")
    return executor, scheduler


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(ckpt), tokenizer=tok,
                           image_seq_length=GEMMA3_MM_TOKENS)
    return proc, tok, transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt).eval()


def _hf_text(hf, image, new_tokens: int) -> str:
    proc, tok, model = hf
    enc = proc(images=[[image]], text=f"<|im_start|>user\n<start_of_image>{TEXT}<|im_end|>\n<|im_start|>assistant\n",
               return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _chat(stack, image, max_tokens: int = 5):
    client = openai.OpenAI(base_url=f"{stack[1].process.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    return client.chat.completions.create(model="m", max_tokens=max_tokens, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]}])


def test_openai_chat_with_a_data_url_matches_transformers(stack, hf):
    info = stack[0].stub.GetInfo(epb.GetInfoRequest())
    assert "vision" in info.capabilities and info.vision.family == "gemma3"
    assert (info.vision.tokens_per_tile, info.vision.tile_size) == (GEMMA3_MM_TOKENS, 32)
    image = noise_image(50, 70, seed=12)
    first = _chat(stack, image)
    assert first.choices[0].message.content == _hf_text(hf, image, 5)
    encoded = stack[0].stub.GetMetrics(epb.GetMetricsRequest()).vision.images_encoded
    again = _chat(stack, image)  # the same request: its blocks are reused, image tokens and all
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16
    assert stack[0].stub.GetMetrics(epb.GetMetricsRequest()).vision.images_encoded == encoded
    other = noise_image(50, 70, seed=13)
    assert _chat(stack, other).choices[0].message.content == _hf_text(hf, other, 5)
