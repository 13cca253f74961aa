"""KV moved between executors: pinned exports, the importing client, the RPC halves, their flags."""
