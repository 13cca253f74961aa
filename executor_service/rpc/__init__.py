"""The executor's gRPC edge: servicer, interceptor, codec, auth scopes, reply sizes, KV event streams."""
