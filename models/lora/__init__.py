"""LoRA adapters: their weights loaded and checked, and the stacks a mixed batch applies."""
