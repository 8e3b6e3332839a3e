"""Adapters to other libraries' objects: torchrl (:mod:`lmcollect.compat.torchrl`), reasoning-gym
(:mod:`lmcollect.compat.reasoning_gym`); each imports its library on first use (see docs/environments.md)."""
