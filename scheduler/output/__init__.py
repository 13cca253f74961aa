"""Text out: step outcomes, the output processor, request streams and events, detokenizing, stop strings."""
