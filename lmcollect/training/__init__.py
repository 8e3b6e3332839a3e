"""Training pieces of the demo: GRPO advantages and loss, and a short supervised warm-up (plain torch)."""
