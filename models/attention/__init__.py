"""Paged attention: the packed-batch forward, the all-decode form, backends (gathered, flex, FlashInfer)."""
