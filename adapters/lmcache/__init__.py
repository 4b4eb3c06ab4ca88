"""LMCache 0.5.6 storage plugin: producer chunks in as semantic codes, consumer chunks out as their own KV."""
