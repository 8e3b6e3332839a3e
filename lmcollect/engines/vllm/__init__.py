"""The vLLM backend: the engine, its worker extension, direct loads, shared-memory payloads and KV bookkeeping."""
