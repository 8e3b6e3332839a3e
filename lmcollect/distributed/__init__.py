"""Ray plumbing shared by the Ray collector, the Ray replay buffer and the Ray weight updater."""
