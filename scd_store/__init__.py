"""scd-store: a KV-cache store for many fine-tunes of one base model, kept as semantic codes."""

__version__ = "0.1.0"
