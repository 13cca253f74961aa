"""Security pieces both servers share: TLS credentials that reload without a restart (tls.py), bearer tokens
with scopes read from a file that is re-read when it changes (tokens.py, auth.py), the gRPC interceptors that
check them (grpc_auth.py), the flags both CLIs take (config.py), and the safe-by-default rule with the one-line
security posture of the startup log (posture.py). Nothing here logs a token, a prompt or an output."""
