"""KV events: the hub, SubscribeKvEvents streams, and vLLM-format ZMQ publishing."""
