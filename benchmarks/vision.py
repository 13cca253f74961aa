"""Vision benchmark (issue 48): for one image (448x448 by default) in process, on a random-weight checkpoint of
SmolVLM-256M's shapes (SigLIP-B/16 at 512 px tiles, scale factor 4: 64 rows a tile; a 30-layer 576-wide Llama
text tower; images resized to a longest edge of 2048, so a 448x448 image is 4 x 4 tiles + the global one: 17
tiles, 1088 image tokens): the scheduler's image processing time, the vision encoder's time, and time to first
token of a chat prompt (executor forward of the whole prompt + sampling) cold (the encoder runs), with the
embedding cache (same image after other text: the prompt is computed, the encoder is not) and with the prefix
cache (the same prompt again: its blocks are reused). --quick: 2048 -> 512 (one tile), 2 text layers.
--family qwen2_5_vl: Qwen2.5-VL-3B's shapes instead (a 32-block 1280-wide window-attention ViT, patch 14, merge 2:
a 448x448 image is 32 x 32 patches, 256 image tokens; a 36-layer 2048-wide Qwen2 text tower; --quick: 2 text
layers).

    python -m benchmarks vision [--quick] [--family idefics3|qwen2_5_vl] [--out results/vision.json]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import machine_info, table, write_json

VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
              patch_size=16)
TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _checkpoint(out: Path, quick: bool) -> Path:
    import torch
    import transformers
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import load_script
    from tests.vision_checkpoints import make_idefics3_checkpoint
    maker = load_script("make_tiny_checkpoint")
    make_idefics3_checkpoint(out, maker)  # the tokenizer, template and processor files, then real-size weights:
    tok_vocab = transformers.AutoTokenizer.from_pretrained(out).vocab_size + 64
    text = dict(TEXT, vocab_size=tok_vocab, num_hidden_layers=2 if quick else TEXT["num_hidden_layers"])
    cfg = transformers.Idefics3Config(text_config=text, vision_config=VISION, scale_factor=4,
                                      image_token_id=transformers.AutoTokenizer.from_pretrained(out)
                                      .convert_tokens_to_ids("<image>"))
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.Idefics3ForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    from tests.vision_checkpoints import image_processor_class
    image_processor_class()(size={"longest_edge": 512 if quick else 2048}, max_image_size={"longest_edge": 512},
                            do_image_splitting=True).save_pretrained(out)
    return out


QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                   fullatt_block_indexes=[7, 15, 23, 31])
QWEN_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 use_sliding_window=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})


def _qwen_checkpoint(out: Path, quick: bool) -> Path:
    import torch
    import transformers
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import load_script
    from tests.qwen_vl_checkpoint import image_processor_class, make_qwen2_5_vl_checkpoint
    make_qwen2_5_vl_checkpoint(out, load_script("make_tiny_checkpoint"))  # tokenizer, template; weights below
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = dict(QWEN_TEXT, vocab_size=tok.vocab_size + 64, num_hidden_layers=2 if quick else 36)
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=QWEN_VISION, tie_word_embeddings=True,
                                        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"))
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    image_processor_class()().save_pretrained(out)  # Qwen2.5-VL's defaults: 56x56 .. 12845056 pixels
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks vision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one tile, 2 text layers (a smoke run)")
    ap.add_argument("--size", type=int, default=448, help="the image's width and height in pixels (default 448)")
    ap.add_argument("--family", choices=("idefics3", "qwen2_5_vl"), default="idefics3",
                    help="the checkpoint's shapes: SmolVLM-256M's (default) or Qwen2.5-VL-3B's")
    ap.add_argument("--out", default="results/vision.json")
    args = ap.parse_args(argv)
    from executor_service.types import ImageInput, UnifiedItem
    from scheduler.text.tokenizer import ChatMessage, ModelTokenizer
    from scheduler.vision.chat_images import ChatImages
    from scheduler.vision.media_policy import MediaPolicy
    from tests.executor_driver import make_executor, raising
    from tests.vision_checkpoints import noise_image

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = (_qwen_checkpoint(Path(tmp) / "qwen2.5-vl-3b-shapes", args.quick) if args.family == "qwen2_5_vl"
                else _checkpoint(Path(tmp) / "smolvlm-256m-shapes", args.quick))
        chat, tok = ChatImages.load(ckpt, MediaPolicy()), ModelTokenizer(ckpt)
        ex = make_executor(ckpt, kv_blocks=1024, max_batch_tokens=8192)
        image = noise_image(args.size, args.size, seed=1)
        start = time.perf_counter()
        processed = chat.processor.process(image)
        process_s = time.perf_counter() - start

        def ttft(before: str) -> tuple[float, int, int]:
            parts = ({"type": "text", "text": before},) if before else ()
            ids, placed = chat.encode_chat(tok, [ChatMessage("user", parts + ({"type": "image"},
                                                                             {"type": "text", "text": "Describe."}))],
                                           [processed])
            images = tuple(ImageInput(p.content_hash, p.offset, p.length, "float32", p.shape, p.pixels) for p in placed)
            (cid, cached) = _create(ex, ids, images)
            t0 = time.perf_counter()
            (res,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[cached:]), cid, cached, images=tuple(
                im for im in images if im.offset + im.length > cached))]))
            took = time.perf_counter() - t0
            ex.release_cache([res.cache.cache_id])
            return took, len(ids), cached

        rows = []
        for case, before in (("cold (encoder runs)", ""), ("embedding cache (other text first)", "Look, please."),
                             ("prefix cache (same prompt)", "Look, please.")):
            enc0 = ex.vision_stats().encode_seconds
            took, n, cached = ttft(before)
            rows.append({"case": case, "prompt tokens": n, "reused": cached, "TTFT s": round(took, 3),
                         "encoder s": round(ex.vision_stats().encode_seconds - enc0, 3)})
    import os
    print(f"{args.family}, image {args.size}x{args.size}: pixels {list(processed.pixels.shape)}; scheduler processing "
          f"{process_s * 1000:.1f} ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(table(rows, 3))
    write_json(args.out, {"machine": machine_info(), "quick": args.quick, "size": args.size, "family": args.family,
                          "pixels_shape": list(processed.pixels.shape), "process_ms": process_s * 1000, "rows": rows})
    return 0


def _create(ex, ids, images):
    from executor_service.types import CreateCacheItem
    from tests.executor_driver import raising
    spans = tuple(ImageSpan(i.content_hash, i.offset, i.length, i.shape) for i in images)
    (res,) = raising(ex.create_caches([CreateCacheItem(tuple(ids), images=spans)]))
    return res.cache.cache_id, res.cached_tokens


def ImageSpan(content_hash, offset, length, shape):  # noqa: N802  (an ImageInput without pixels: CreateCache's)
    from executor_service.types import ImageInput
    return ImageInput(content_hash, offset, length, shape=shape)
