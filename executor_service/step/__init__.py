"""Running model calls: batches, multi-step decode, drafts (n-gram, the draft model's), the one decode-step decision, the op lock."""
