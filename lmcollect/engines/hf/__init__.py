"""The transformers backend: continuous batching of our own over a causal LM (TransformersEngine)."""
