"""Qwen2.5-VL through real processes (issue 48): a tiny random checkpoint served by an executor and a scheduler,
against transformers on the same image and text — through the executor's gRPC contract (UnifiedDecode with the
processor's patches as ImageInput) and through the OpenAI chat route with the image as a base64 data URL, sent by
the `openai` package, prefill chunks of 16 tokens so that the image's tokens run over several chunks, and the
answer's decode steps at M-RoPE positions. A repeated image hits the executor's embedding cache and its prefix
cache, whose reused blocks lie past the image (their shift comes with CreateCache)."""
from __future__ import annotations

import base64

import openai
import pytest
import torch

from tandem.executor.v1 import executor_pb2 as epb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.hf_reference import rel_err
from tests.qwen_vl_checkpoint import MERGE, image_processor_class, qwen_vl_checkpoint
from tests.vision_checkpoints import noise_image, png_bytes

TEXT = "Describe the fish in the picture, and the boat, and the sea around them."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen_vl_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(request, ckpt):
    executor = start_for(request, ckpt, "--kv-blocks", "256")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0", "--prefill-chunk", "16",
                                    "--served-model-name", "m")
    return executor, scheduler


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[1].process.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt).eval()
    return tok, image_processor_class().from_pretrained(ckpt), model


def _hf(hf, image, new_tokens: int):
    tok, proc, model = hf
    enc = proc(images=[image], return_tensors="pt")
    pads = "<|image_pad|>" * (int(enc["image_grid_thw"][0].prod()) // MERGE ** 2)
    ids = tok(f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{TEXT}<|im_end|>\n<|im_start|>assistant\n"
              )["input_ids"]
    types = torch.tensor([[int(t == model.config.image_token_id) for t in ids]])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=enc["pixel_values"],
                             image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=types,
                             max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return ids, enc, out.sequences[0, len(ids):].tolist(), out.logits


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def _chat(client, url: str, max_tokens: int = 6):
    return client.chat.completions.create(
        model="m", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": TEXT}]}])


def _vision_stats(stack) -> epb.VisionStats:
    return stack[0].stub.GetMetrics(epb.GetMetricsRequest()).vision


def test_executor_contract_logits_match_transformers(stack, hf):
    info = stack[0].stub.GetInfo(epb.GetInfoRequest())
    assert "vision" in info.capabilities and info.vision.family == "qwen2_5_vl"
    image = noise_image(50, 70, seed=11)
    ids, enc, want, logits = _hf(hf, image, 1)
    _, rows, cols = enc["image_grid_thw"][0].tolist()
    pixels = enc["pixel_values"].numpy().astype("<f4").reshape(rows // MERGE, cols // MERGE, MERGE, MERGE, -1)
    pad = hf[2].config.image_token_id
    item = epb.UnifiedItem(token_ids=ids, is_final_chunk=True,
                           output=epb.OutputOptions(mode=epb.OUTPUT_MODE_TOKENS_AND_LOGITS),
                           images=[epb.ImageInput(dtype="float32", shape=pixels.shape, pixel_values=pixels.tobytes(),
                                                  offset=ids.index(pad), length=ids.count(pad))])
    (res,) = stack[0].stub.UnifiedDecode(epb.UnifiedDecodeRequest(items=[item])).results
    got = torch.frombuffer(bytearray(res.output.logits.data), dtype=torch.float32)
    assert rel_err(got, logits[0][0]) <= 1e-4
    assert res.output.tokens[0].token_id == want[0]
    stack[0].stub.ReleaseCache(epb.ReleaseCacheRequest(cache_ids=[res.cache.cache_id]))


def test_openai_chat_with_a_data_url_matches_transformers(stack, client, hf):
    image = noise_image(90, 40, seed=12)  # 48 image tokens: over several 16-token chunks
    _, _, want, _ = _hf(hf, image, 6)
    before = _vision_stats(stack)
    first = _chat(client, _data_url(image))
    assert first.choices[0].message.content == hf[0].decode(want, skip_special_tokens=True)
    mid = _vision_stats(stack)
    assert mid.images_encoded == before.images_encoded + 1
    again = _chat(client, _data_url(image))  # the same request: its blocks are reused, past the image
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16
    assert _vision_stats(stack).images_encoded == mid.images_encoded


def test_generate_service_and_responses_take_images(stack, client, hf):
    from tandem.generate.v1 import generate_pb2 as gpb
    from tests.scheduler_client import collect
    image = noise_image(64, 64, seed=14)
    _, _, want, _ = _hf(hf, image, 4)
    parts = [gpb.ContentPart(image=gpb.ImageSource(data=png_bytes(image))), gpb.ContentPart(text=TEXT)]
    request = gpb.GenerateRequest(messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", parts=parts)]),
                                  stopping=gpb.StoppingCriteria(max_new_tokens=4, ignore_eos=True))
    assert collect(stack[1].stub, request).token_ids == want
    r = client.responses.create(model="m", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": _data_url(image)},
                                     {"type": "input_text", "text": TEXT}]}])
    assert r.output_text == hf[0].decode(want, skip_special_tokens=True)
