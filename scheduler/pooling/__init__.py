"""Embeddings and scores: requests that pool a prompt's final hidden states (or score it) instead of generating."""
