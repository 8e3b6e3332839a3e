"""The lockstep collector: every env steps together, one policy call per turn (LLMCollector)."""
