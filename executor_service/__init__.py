"""The executor process: loads the model, owns the paged KV cache and runs the forward behind tandem.executor.v1."""
