"""GGUF files: reading, metadata -> config, tensor names, loading into a DecoderModel."""
