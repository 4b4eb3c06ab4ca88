"""Model material: the producer, the project's own fine-tuned consumers, and their corpora."""
