"""Images in, text out through real processes (issue 48): a tiny random Idefics3 (SmolVLM's architecture)
checkpoint served by an executor and a scheduler, against transformers on the same image and text — through the
executor's gRPC contract (UnifiedDecode with ImageInput) and through the OpenAI chat route with the image as a
base64 data URL, sent by the `openai` package. A repeated image hits the executor's embedding cache and its
prefix cache; the same text with another image answers differently and reuses no KV past the text before it;
bad images are 400s naming the part."""
from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
import torch

from executor_service.vision.image_checks import MAX_TILES
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as gpb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.hf_reference import rel_err
from tests.scheduler_client import collect
from tests.vision_checkpoints import image_processor_class, noise_image, png_bytes, vision_checkpoint

TEXT = "Describe the fish."
MAX_IMAGE_BYTES = 40_000  # the scheduler's limits here (a 90x90 noise PNG is ~24 KB)
MAX_IMAGE_PIXELS = 20_000


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def stack(request, ckpt, media):
    executor = start_for(request, ckpt, "--kv-blocks", "256")
    # --prefill-chunk 16: an image's placeholder tokens (up to 5 tiles x 4 + markers) run over several chunks
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0", "--prefill-chunk", "16",
                                    "--served-model-name", "m",
                                    "--allowed-media-path", str(media), "--max-image-bytes", str(MAX_IMAGE_BYTES),
                                    "--max-image-pixels", str(MAX_IMAGE_PIXELS))
    return executor, scheduler


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[1].process.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    proc = Idefics3Processor(image_processor=image_processor_class().from_pretrained(ckpt), tokenizer=tok,
                             image_seq_len=4)
    return proc, tok, transformers.Idefics3ForConditionalGeneration.from_pretrained(ckpt).eval()


def _hf(hf, image, new_tokens: int):
    proc, tok, model = hf
    enc = proc(images=[[image]], text=f"<|im_start|>user\n<image>{TEXT}<|im_end|>\n<|im_start|>assistant\n",
               return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return enc, out.sequences[0, enc["input_ids"].shape[1]:].tolist(), out.logits


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def _chat(client, url: str, max_tokens: int = 5, before: str = "", **kw):
    """A chat of one image and TEXT (before: a text part ahead of the image)."""
    parts = [{"type": "text", "text": before}] if before else []
    return client.chat.completions.create(
        model="m", max_tokens=max_tokens, temperature=0, **kw,
        messages=[{"role": "user", "content": [*parts, {"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": TEXT}]}])


def _vision_stats(stack) -> epb.VisionStats:
    return stack[0].stub.GetMetrics(epb.GetMetricsRequest()).vision


def test_executor_contract_logits_match_transformers(stack, hf):
    info = stack[0].stub.GetInfo(epb.GetInfoRequest())
    assert "vision" in info.capabilities and info.vision.family == "idefics3"
    assert (info.vision.tokens_per_tile, info.vision.tile_size, info.vision.max_tiles) == (4, 32, MAX_TILES)
    image = noise_image(50, 70, seed=11)
    enc, want, logits = _hf(hf, image, 1)
    ids = enc["input_ids"][0].tolist()
    pixels = enc["pixel_values"][0].numpy().astype("<f4")
    fake = hf[1].convert_tokens_to_ids("<fake_token_around_image>")
    marks = [i for i, t in enumerate(ids) if t == fake]
    item = epb.UnifiedItem(token_ids=ids, is_final_chunk=True,
                           output=epb.OutputOptions(mode=epb.OUTPUT_MODE_TOKENS_AND_LOGITS),
                           images=[epb.ImageInput(dtype="float32", shape=pixels.shape, pixel_values=pixels.tobytes(),
                                                  offset=marks[0], length=marks[-1] - marks[0] + 1)])
    (res,) = stack[0].stub.UnifiedDecode(epb.UnifiedDecodeRequest(items=[item])).results
    got = torch.frombuffer(bytearray(res.output.logits.data), dtype=torch.float32)
    assert rel_err(got, logits[0][0]) <= 1e-4
    assert res.output.tokens[0].token_id == want[0]
    stack[0].stub.ReleaseCache(epb.ReleaseCacheRequest(cache_ids=[res.cache.cache_id]))


def test_openai_chat_with_a_data_url_matches_transformers(stack, client, hf):
    image = noise_image(90, 40, seed=12)  # 3 x 2 tiles + the global one: the image runs over several chunks
    _, want, _ = _hf(hf, image, 5)
    before = _vision_stats(stack)
    first = _chat(client, _data_url(image))
    assert first.choices[0].message.content == hf[1].decode(want, skip_special_tokens=True)
    mid = _vision_stats(stack)
    assert mid.images_encoded == before.images_encoded + 1
    again = _chat(client, _data_url(image))  # the same request: its blocks are reused, image tokens and all
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16
    assert _vision_stats(stack).images_encoded == mid.images_encoded
    # the same image after other text: its tokens are computed again (other positions), its embedding is not
    _chat(client, _data_url(image), before="Look at this picture, please.")
    after = _vision_stats(stack)
    assert after.images_encoded == mid.images_encoded and after.embedding_cache_hits > mid.embedding_cache_hits


def test_another_image_with_the_same_text_answers_differently(client):
    def first_logprobs(seed):
        r = _chat(client, _data_url(noise_image(50, 70, seed=seed)), max_tokens=1, logprobs=True, top_logprobs=3)
        return [(t.token, round(t.logprob, 4)) for t in r.choices[0].logprobs.content[0].top_logprobs], r.usage
    a, _ = first_logprobs(21)
    b, usage = first_logprobs(22)
    assert a != b
    # the prompt's blocks from the image's span on are keyed by the image: only the text before it is reused
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens // 2


def test_a_local_file_inside_the_allowed_directory(client, media, hf):
    image = noise_image(20, 24, seed=13)
    (media / "fish.png").write_bytes(png_bytes(image))
    _, want, _ = _hf(hf, image, 3)
    r = _chat(client, f"file://{media / 'fish.png'}", max_tokens=3)
    assert r.choices[0].message.content == hf[1].decode(want, skip_special_tokens=True)


def test_responses_input_image(stack, client, hf):
    image = noise_image(20, 24, seed=15)
    _, want, _ = _hf(hf, image, 3)
    r = client.responses.create(model="m", max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": _data_url(image)},
                                     {"type": "input_text", "text": TEXT}]}])
    assert r.output_text == hf[1].decode(want, skip_special_tokens=True)


def test_generate_service_takes_image_bytes(stack, hf):
    image = noise_image(64, 64, seed=14)
    _, want, _ = _hf(hf, image, 4)
    parts = [gpb.ContentPart(image=gpb.ImageSource(data=png_bytes(image))), gpb.ContentPart(text=TEXT)]
    request = gpb.GenerateRequest(messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", parts=parts)]),
                                  stopping=gpb.StoppingCriteria(max_new_tokens=4, ignore_eos=True))
    assert collect(stack[1].stub, request).token_ids == want
    bad = gpb.GenerateRequest(messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", parts=[
        gpb.ContentPart(image=gpb.ImageSource(data=b"GIF89a nonsense"))])]))
    import grpc
    with pytest.raises(grpc.RpcError) as info:
        collect(stack[1].stub, bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].parts[0].image" in info.value.details()


@pytest.mark.parametrize("case,why", [("not_an_image", "not an image"), ("too_large", "--max-image-bytes"),
                                      ("too_many_pixels", "--max-image-pixels"), ("outside_dir", "--allowed-media-path"),
                                      ("url", "--allow-media-urls"), ("bad_base64", "base64")])
def test_bad_images_are_400s_naming_the_part(stack, media, tmp_path, case, why):
    if case == "not_an_image":
        url = "data:image/png;base64," + base64.b64encode(b"this is not a picture").decode()
    elif case == "too_large":
        url = "data:image/png;base64," + base64.b64encode(b"\0" * (MAX_IMAGE_BYTES + 10)).decode()
    elif case == "too_many_pixels":
        from PIL import Image
        url = _data_url(Image.new("RGB", (200, 101)))  # one color: a small file of 20200 pixels
    elif case == "outside_dir":
        (tmp_path / "x.png").write_bytes(png_bytes(noise_image(8, 8)))
        url = f"file://{tmp_path / 'x.png'}"
    elif case == "url":
        url = "http://127.0.0.1:9/fish.png"
    else:
        url = "data:image/png;base64,@@@@"
    body = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    r = httpx.post(f"{stack[1].process.http_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = json.loads(r.text)["error"]["message"]
    assert "messages[0].content[1].image_url" in message and why in message, message
    assert str(tmp_path) not in message and str(media) not in message  # no host paths


@pytest.fixture(scope="module")
def small_kv(request, ckpt):
    """An executor with 12 blocks of KV (192 tokens): one image request fits, five at once do not."""
    executor = start_for(request, ckpt, "--kv-blocks", "12", "--no-prefix-caching")
    return executor, start_scheduler_for(request, executor.address, "--speculative", "off")


def test_preempted_image_requests_are_recomputed_with_their_images(small_kv):
    executor, scheduler = small_kv

    def run(seed):
        parts = [gpb.ContentPart(image=gpb.ImageSource(data=png_bytes(noise_image(50, 70, seed=seed)))),
                 gpb.ContentPart(text=TEXT)]
        return collect(scheduler.stub, gpb.GenerateRequest(
            messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", parts=parts)]),
            stopping=gpb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)))

    seeds = [41, 42, 43, 44, 45]
    alone = [run(s) for s in seeds]
    assert all(r.usage.preemptions == 0 for r in alone)
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(len(seeds)) as pool:
        together = list(pool.map(run, seeds))
    assert sum(r.usage.preemptions for r in together) > 0, "the pool was meant to be too small for all at once"
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
