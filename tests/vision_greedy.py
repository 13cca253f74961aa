"""transformers' greedy tokens for a one-image chat prompt on the tiny vision checkpoints (tests/vision_checkpoints.py,
tests/qwen_vl_checkpoint.py), with the prompt's token ids and its image as the executor contract's ImageInput: the
reference of the tests that move image caches between executors."""
from __future__ import annotations

import torch

from tandem.executor.v1 import executor_pb2 as pb
from tests.qwen_vl_checkpoint import MERGE
from tests.qwen_vl_checkpoint import image_processor_class as qwen_processor_class
from tests.vision_checkpoints import image_processor_class

TEXT = "Describe the fish in the picture, and the boat."


def idefics3_greedy(ckpt, image, new_tokens: int, text: str = TEXT):
    """(prompt ids, its ImageInput, transformers' greedy tokens) for one image and text, as the chat template
    writes them."""
    import transformers
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    proc = Idefics3Processor(image_processor=image_processor_class().from_pretrained(ckpt), tokenizer=tok,
                             image_seq_len=4)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(ckpt).eval()
    enc = proc(images=[[image]], text=f"<|im_start|>user\n<image>{text}<|im_end|>\n<|im_start|>assistant\n",
               return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
    ids = enc["input_ids"][0].tolist()
    pixels = enc["pixel_values"][0].numpy().astype("<f4")
    fake = tok.convert_tokens_to_ids("<fake_token_around_image>")
    marks = [i for i, t in enumerate(ids) if t == fake]
    image_input = pb.ImageInput(dtype="float32", shape=pixels.shape, pixel_values=pixels.tobytes(), offset=marks[0],
                                length=marks[-1] - marks[0] + 1)
    return ids, image_input, out[0, len(ids):].tolist()


def qwen2_5_vl_greedy(ckpt, image, new_tokens: int, text: str = TEXT):
    """As idefics3_greedy, for Qwen2.5-VL."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    proc = qwen_processor_class().from_pretrained(ckpt)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt).eval()
    enc = proc(images=[image], return_tensors="pt")
    pads = "<|image_pad|>" * (int(enc["image_grid_thw"][0].prod()) // MERGE ** 2)
    ids = tok(f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"
              )["input_ids"]
    types = torch.tensor([[int(t == model.config.image_token_id) for t in ids]])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=enc["pixel_values"],
                             image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=types,
                             max_new_tokens=new_tokens, do_sample=False)
    _, rows, cols = enc["image_grid_thw"][0].tolist()
    pixels = enc["pixel_values"].numpy().astype("<f4").reshape(rows // MERGE, cols // MERGE, MERGE, MERGE, -1)
    pad = model.config.image_token_id
    image_input = pb.ImageInput(dtype="float32", shape=pixels.shape, pixel_values=pixels.tobytes(),
                                offset=ids.index(pad), length=ids.count(pad))
    return ids, image_input, out[0, len(ids):].tolist()
