"""vLLM's engine protocol as smg speaks it (generated from the pinned vllm_engine.proto)."""
