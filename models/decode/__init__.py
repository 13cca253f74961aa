"""Decode-step implementations: native C++, row-invariant (deterministic), compiled, CUDA graphs."""
