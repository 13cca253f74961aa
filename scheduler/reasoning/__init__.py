"""Reasoning parsers: a model's thinking split from its answer, whole or streamed (text only, torch-free)."""
