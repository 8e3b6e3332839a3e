"""Adapters to other libraries: torchrl (:mod:`lmcollect.compat.torchrl`), reasoning-gym
(:mod:`lmcollect.compat.reasoning_gym`), math-verify (:mod:`lmcollect.compat.math_verify_reward`) and
TRL-style reward functions (:mod:`lmcollect.compat.trl_rewards`); each imports its library on first use
(see docs/environments.md)."""
