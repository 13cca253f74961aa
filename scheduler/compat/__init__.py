"""Other engines' protocols: vLLM's engine protocol (for smg) and the gauges llm-d reads."""
