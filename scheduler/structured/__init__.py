"""Structured output: grammars compiled with llguidance, per-sequence constraints, token masks."""
