"""The scheduler's tokenizer files as one zip archive, for a router that tokenizes itself and fetches them over
gRPC (VllmEngine.GetTokenizer, smg's `smg.grpc.common.GetTokenizerChunk` stream): the same files smg's own
servicers bundle, with the archive's SHA-256 on the last chunk. A --chat-template given to the scheduler goes in
as chat_template.jinja, so the router renders chat prompts as the scheduler would."""
from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import CheckpointError, Unsupported
from tandem.model_path import is_gguf

CHUNK_BYTES = 64 * 1024  # per message: what smg's servicers send (its client accepts any size)
MAX_FILE_BYTES = 64 * 1024 * 1024  # a tokenizer file past this is not a tokenizer file (a mislaid weight file)
# The files smg's servicers bundle (smg_grpc_servicer/tokenizer_bundle.py), by name and by pattern
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
         "chat_template.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
PATTERNS = ("*.tiktoken", "*.jinja", "*.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class Bundle:
    data: bytes
    sha256: str  # hex, of the whole archive

    def chunks(self) -> list[bytes]:
        return [self.data[i:i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)]


def build(model_dir: Path, chat_template: str | None = None) -> Bundle:
    """The archive of model_dir's tokenizer files (run off the event loop: it reads and compresses files).
    chat_template: the scheduler's own (--chat-template), written over the directory's."""
    if is_gguf(model_dir):
        raise Unsupported("this scheduler reads its tokenizer from a GGUF file, which a router cannot load: give "
                          "the router the tokenizer directory of the same model (smg --model-path or "
                          "--tokenizer-path)")
    names: dict[str, Path] = {}
    for name in FILES:
        if (model_dir / name).is_file():
            names[name] = model_dir / name
    for pattern in PATTERNS:
        for path in sorted(model_dir.glob(pattern)):
            if path.is_file():
                names.setdefault(path.name, path)
    if not names:
        raise CheckpointError("the scheduler's tokenizer directory holds no tokenizer files")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, path in names.items():
            if name == CHAT_TEMPLATE_FILE and chat_template is not None:
                continue
            if path.stat().st_size > MAX_FILE_BYTES:
                raise CheckpointError(f"tokenizer file {name} is over {MAX_FILE_BYTES >> 20} MiB")
            zf.write(path, name)
        if chat_template is not None:
            zf.writestr(CHAT_TEMPLATE_FILE, chat_template)
    data = buf.getvalue()
    return Bundle(data, hashlib.sha256(data).hexdigest())
