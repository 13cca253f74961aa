"""LoRA on a vision-language model's language model through real processes: a tiny random Idefics3 (SmolVLM's
architecture) served by an executor (a peft adapter on the text tower preloaded with --adapter) and a scheduler;
the `openai` package sends a chat with the image as a base64 data URL and `model` = the adapter's name, after a
base-model chat of the same image, and each answers with transformers' greedy tokens (with peft's adapter for the
first); the image's embedding is shared by both, its KV blocks are not. An adapter on the vision encoder is
INVALID_ARGUMENT at LoadAdapter, naming the module, no host path."""
from __future__ import annotations

import base64

import grpc
import openai
import pytest
import torch

from tandem.executor.v1 import executor_pb2 as epb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.lora_fixtures import make_peft_adapter
from tests.scheduler_client import rpc_error
from tests.vision_checkpoints import image_processor_class, noise_image, png_bytes, vision_checkpoint

TEXT = "Describe the fish."
TEXT_TOWER = r".*\.text_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
STEPS = 8


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    import transformers
    ckpt = vision_checkpoint(tmp_path_factory)
    root = tmp_path_factory.mktemp("vision-adapters")
    cls = transformers.Idefics3ForConditionalGeneration
    make_peft_adapter(ckpt, root / "fish", r=8, alpha=16, target_modules=TEXT_TOWER, seed=1, model_class=cls)
    # peft's plain list: the vision tower's q_proj and v_proj are adapted too
    make_peft_adapter(ckpt, root / "encoder", r=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=2,
                      model_class=cls)
    executor = start_for(request, ckpt, "--kv-blocks", "256", "--adapter-root", str(root),
                         "--adapter", f"fish={root / 'fish'}")
    # --prefill-chunk 16: the image's placeholder tokens run over several chunks, each under the adapter
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0", "--served-model-name", "m",
                                    "--prefill-chunk", "16")
    client = openai.OpenAI(base_url=f"{scheduler.process.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    return ckpt, root, executor, client


def _reference(ckpt, adapter_dir, image) -> str:
    """transformers' (with peft's adapter when given) greedy answer, decoded as the chat route does."""
    import transformers
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    proc = Idefics3Processor(image_processor=image_processor_class().from_pretrained(ckpt), tokenizer=tok,
                             image_seq_len=4)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(ckpt).eval()
    if adapter_dir is not None:
        from peft import PeftModel
        PeftModel.from_pretrained(model, adapter_dir)  # wraps the layers of `model` in place
    enc = proc(images=[[image]], text=f"<|im_start|>user\n<image>{TEXT}<|im_end|>\n<|im_start|>assistant\n",
               return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=STEPS, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1]:].tolist(), skip_special_tokens=True)


def test_openai_chat_under_an_adapter_matches_peft(setup):
    """The base model's chat, then the adapter's with the same image: the image is encoded once (its embedding
    is shared) but none of the base model's KV blocks serve the adapter; the adapter's repeat reuses its own."""
    ckpt, root, executor, client = setup
    image = noise_image(50, 70, seed=21)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()

    def chat(model: str):
        return client.chat.completions.create(
            model=model, max_tokens=STEPS, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": TEXT}]}])

    def vision() -> epb.VisionStats:
        return executor.stub.GetMetrics(epb.GetMetricsRequest()).vision

    def cached(reply) -> int:
        details = reply.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    before = vision()
    base = chat("m")
    assert base.choices[0].message.content == _reference(ckpt, None, image)
    mid = vision()
    assert mid.images_encoded == before.images_encoded + 1
    adapted = chat("fish")
    assert adapted.model == "fish"
    assert adapted.choices[0].message.content == _reference(ckpt, root / "fish", image)
    assert adapted.choices[0].message.content != base.choices[0].message.content
    assert cached(adapted) == 0  # the base model's blocks hold the base model's KV
    after = vision()
    assert after.images_encoded == mid.images_encoded and after.embedding_cache_hits > mid.embedding_cache_hits
    again = chat("fish")
    assert again.choices[0].message.content == adapted.choices[0].message.content
    assert cached(again) >= again.usage.prompt_tokens - 16  # its own blocks, image tokens and all
    assert vision().images_encoded == mid.images_encoded


def test_an_encoder_adapter_is_invalid_argument(setup):
    ckpt, root, executor, client = setup
    err = rpc_error(lambda: executor.stub.LoadAdapter(epb.LoadAdapterRequest(name="enc", path="encoder")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'model.vision_model.encoder.layers." in err.details() and "vision encoder" in err.details()
    assert str(root) not in err.details() and str(ckpt) not in err.details()
    assert [a.name for a in executor.stub.ListAdapters(epb.ListAdaptersRequest()).adapters] == ["fish"]
