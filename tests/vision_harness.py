"""What the in-process vision tests share (tests/models/test_vision_*.py): a chat prompt with images made by the
scheduler's own ChatImages (processor, placeholder text, spans) and turned into the executor's ImageInput items."""
from __future__ import annotations

from executor_service.types import ImageInput
from scheduler.text.tokenizer import ChatMessage


def chat_prompt(ours, images, text: str = "Describe the fish."):
    """ours: (ChatImages, ModelTokenizer); images: PIL images -> (token ids, their ImageInput items)."""
    chat, tok = ours
    parts = tuple({"type": "image"} for _ in images) + ({"type": "text", "text": text},)
    ids, placed = chat.encode_chat(tok, [ChatMessage("user", parts)], [chat.processor.process(i) for i in images])
    items = tuple(ImageInput(p.content_hash, p.offset, p.length, "float32", p.shape, p.pixels) for p in placed)
    return ids, items
