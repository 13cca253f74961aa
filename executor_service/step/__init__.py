"""Running model calls: batches, multi-step decode, drafts, the one decode-step decision, the op lock."""
