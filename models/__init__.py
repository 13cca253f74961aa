"""The model code: configs and loaders, the decoder, paged KV, attention, decode steps, sampling (no gRPC)."""
