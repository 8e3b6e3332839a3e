"""Checks users run on collected data: do the stored log-probs match the trainer's forward pass?"""

from lmcollect.lazy import lazy_attributes

# torch is slow to import: lmcollect.diagnostics.logprobs is imported when one of its names is first
# used, so that the pure-Python lmcollect.diagnostics.rollout_files can be imported without it
_LAZY = dict.fromkeys(("LogProbReport", "check_logprobs", "compare_log_probs"), "lmcollect.diagnostics.logprobs")

__all__ = [*_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)
