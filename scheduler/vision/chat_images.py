"""A chat prompt with images -> token ids and the images' pixels with their placeholder spans.

The chat template writes a marker (`<image>`; Gemma 3: `<start_of_image>`) where each image part sits; each
marker is replaced by the model's placeholder text for that image (its tiles, as its processor split it), the
whole is tokenized, and each image's span is the tokens of its placeholder text (Gemma 3: of its image tokens).
The executor puts the image's embedding rows at the span's image-token positions (UnifiedItem.images). Loading
and processing run in the scheduler's worker threads (codec.request_from_pb runs there), never on the event
loop.

Which models: those whose config.json names a vision family served here (Idefics3 / SmolVLM: `<image>`; Gemma 3;
Qwen2.5-VL: `<|image_pad|>`, between the template's own vision_start / vision_end), with a preprocessor_config.json
beside; ChatImages.load returns None for any other model, and a request with images
for it is refused."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from scheduler.text.tokenizer import ChatMessage, ModelTokenizer, Tool
from scheduler.vision.gemma3_processor import Gemma3ImageProcessor
from scheduler.vision.idefics3_processor import Idefics3ImageProcessor
from scheduler.vision.pixels import ProcessedImage
from scheduler.vision.media import load_image
from scheduler.vision.media_policy import MediaPolicy
from scheduler.vision.qwen2_vl_processor import Qwen2VLImageProcessor
from tandem.errors import CheckpointError, InvalidRequest
from tandem.image_hash import image_hash

IDEFICS3 = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
GEMMA3 = ("Gemma3ForConditionalGeneration",)
QWEN2_5_VL = ("Qwen2_5_VLForConditionalGeneration",)
Processor = Idefics3ImageProcessor | Gemma3ImageProcessor | Qwen2VLImageProcessor


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt as the executor takes it (the contract's ImageInput)."""

    offset: int  # first token of its placeholder span
    length: int  # tokens in the span
    content_hash: str  # tandem/image_hash.py
    shape: tuple[int, ...]  # [tiles, 3, tile, tile] (Qwen2.5-VL: [rows, columns, merge, merge, patch features])
    pixels: bytes  # float32 little-endian, row-major
    # Its span's tokens attend to each other both ways (Gemma 3): the span is prefilled in one chunk
    # (scheduler/vision/image_chunks.py)
    one_chunk: bool = False


class ChatImages:
    def __init__(self, processor: Processor, policy: MediaPolicy) -> None:
        self.processor = processor
        self.policy = policy

    @classmethod
    def load(cls, model_dir: Path, policy: MediaPolicy) -> "ChatImages | None":
        """The model's image handling, or None when it is not a vision-language model served here."""
        config_path, pre_path = model_dir / "config.json", model_dir / "preprocessor_config.json"
        if not config_path.is_file():
            return None
        cfg = _json(config_path)
        arch = next((a for a in cfg.get("architectures") or () if a in IDEFICS3 + GEMMA3 + QWEN2_5_VL), None)
        if arch is None:
            return None
        if not pre_path.is_file():
            raise CheckpointError(f"{model_dir.name}: a vision-language model needs its preprocessor_config.json "
                                  "(the image processor's settings) beside the tokenizer")
        if arch in QWEN2_5_VL:
            return cls(Qwen2VLImageProcessor(_json(pre_path), pre_path.name), policy)
        v = cfg.get("vision_config") or {}
        if arch in GEMMA3:
            return cls(Gemma3ImageProcessor(_json(pre_path), int(cfg.get("mm_tokens_per_image", 256)), pre_path.name),
                       policy)
        side = int(v.get("image_size", 224)) // int(v.get("patch_size", 32))
        tokens = side * side // int(cfg.get("scale_factor", 2)) ** 2
        return cls(Idefics3ImageProcessor(_json(pre_path), tokens, pre_path.name), policy)

    def load_image(self, where: str, **source) -> ProcessedImage:
        image = load_image(self.policy, where, **source)
        try:
            return self.processor.process(image)
        except InvalidRequest as exc:  # (the processor's own refusals: the part they are about named here)
            raise InvalidRequest(f"{where}: {exc}") from exc

    def encode_chat(self, tok: ModelTokenizer, messages: Sequence[ChatMessage], images: Sequence[ProcessedImage],
                    tools: Sequence[Tool] = (), variables: Mapping[str, Any] | None = None
                    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        text = tok.render_chat(messages, tools, variables)
        marker = self.processor.marker
        pieces = text.split(marker)
        if len(pieces) - 1 != len(images):
            raise InvalidRequest(f"the rendered prompt holds {len(pieces) - 1} image markers ({marker!r}) for "
                                 f"{len(images)} images: the text must not contain {marker!r} itself, and the "
                                 "chat template must write one per image part")
        full, spans = pieces[0], []  # spans: (first char, end char, the image's tiles it takes)
        for im, piece in zip(images, pieces[1:]):
            for text_part, tiles in self.processor.placeholder(im):  # (a span's text where tiles is not None)
                if tiles is not None:
                    spans.append((len(full), len(full) + len(text_part), im.pixels[tiles]))
                full += text_part
            full += piece
        ids, offsets = tok.encode_with_offsets(full)
        out = []
        for lo, hi, tiles in spans:
            inside = [i for i, (a, b) in enumerate(offsets) if a >= lo and b <= hi and b > a]
            pixels = tiles.astype("<f4").tobytes()
            out.append(PromptImage(inside[0], inside[-1] - inside[0] + 1, image_hash("float32", tiles.shape, pixels),
                                   tuple(tiles.shape), pixels, self.processor.one_chunk))
        return ids, tuple(out)


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: cannot read it as JSON: {exc}") from exc
