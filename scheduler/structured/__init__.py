"""Structured output: grammars compiled with llguidance and per-sequence token constraints."""
