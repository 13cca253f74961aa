"""Running model calls: batches, multi-step decode, drafts (n-gram, a draft model), the decode-step choice, the op lock."""
