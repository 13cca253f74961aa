"""The scheduler's client-facing gRPC edge: GenerateService server, servicer, interceptor, codec."""
