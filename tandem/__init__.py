"""What both Tandem processes share, and nothing else: the generated contract (tandem.<service>.v1), the
domain types and codecs both sides of the line speak, the error types and their gRPC status table, the gRPC
server setup, the security pieces both servers use (tandem/security/: TLS, tokens, the posture) and the
server-process launcher.

It imports neither `executor_service` nor `scheduler` nor `models`, and never torch: the scheduler stays
torch-free by importing only this package (tests/shared/test_import_boundaries.py checks both).
"""
