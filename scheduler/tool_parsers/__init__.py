"""The model's own tool-call syntax read out of its text (tool_choice "auto"): one file per family, a registry."""
