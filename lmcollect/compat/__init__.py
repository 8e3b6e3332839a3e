"""Adapters to other RL libraries' objects (torchrl: :mod:`lmcollect.compat.torchrl`)."""
