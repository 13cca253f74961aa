"""The executor's gRPC edge: server, servicer, interceptor, codec, auth scopes, reply sizes."""
