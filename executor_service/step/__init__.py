"""Running model calls: batches, multi-step decode, drafts (n-gram, a draft model), decode-step choice, op lock."""
