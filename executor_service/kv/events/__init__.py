"""KV events: the hub, the ZMQ endpoint and vLLM-format publishing."""
