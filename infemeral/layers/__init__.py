"""The model's own decoder layers, run over our KV caches: which architectures split exactly, attention, and
paged attention for batches of sessions."""
