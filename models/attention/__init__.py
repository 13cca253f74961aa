"""Paged attention: the packed-batch forward, its backends (gathered, flex, FlashInfer) and spec."""
