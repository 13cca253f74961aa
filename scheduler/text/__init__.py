"""Text in: tokenizers (HF and GGUF), the tokenizer bundle, chat inputs."""
