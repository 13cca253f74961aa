"""The scheduler's client-facing gRPC edge: GenerateService servicer, interceptor, tandem.generate.v1 codec."""
