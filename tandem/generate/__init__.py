"""The generated tandem.generate.v1 contract (scripts/gen_protos)."""
