"""Text out: the output processor, request streams and events, detokenizing, stop strings."""
