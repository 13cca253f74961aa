"""Running model calls: batches, multi-step decode, drafts, prompt logprobs, the model thread and lock."""
