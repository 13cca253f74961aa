"""The generated tandem.executor.v1 contract (scripts/gen_protos)."""
