"""Checks users run on collected data: do the stored log-probs match the trainer's forward pass?"""
from lmcollect.diagnostics.logprobs import LogProbReport, check_logprobs, compare_log_probs

__all__ = ["LogProbReport", "check_logprobs", "compare_log_probs"]
