"""Images in the executor: checking UnifiedItem.images, the embedding cache, and the rows a forward merges."""
