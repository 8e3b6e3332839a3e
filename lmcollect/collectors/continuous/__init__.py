"""The continuous collector: every dialog advances on its own against an engine (ContinuousLLMCollector)."""
