"""Security both servers share: reloading TLS, scoped bearer tokens, their gRPC interceptors, flags, posture."""
# Nothing here logs a token, a prompt or an output.
