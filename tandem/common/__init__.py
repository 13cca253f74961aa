"""The generated tandem.common.v1 messages both services use (scripts/gen_protos)."""
