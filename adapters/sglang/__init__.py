"""SGLang HiCache L3 storage backend (``--hicache-storage-backend dynamic``) over scd-store."""
