"""Model-free stand-ins for tests and examples: a scripted engine, a scripted lockstep policy, a byte tokenizer.

They answer from a script (a function of the dialog), so a test of envs, collectors or weight pushes
sees exactly the tokens it expects; nothing here is used by lmcollect's own code paths.
"""

from __future__ import annotations

from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, ScriptedWeights, chat_script
from lmcollect.testing.scripted_policy import ScriptedPolicy

__all__ = ["ByteTokenizer", "ScriptedEngine", "ScriptedPolicy", "ScriptedWeights", "chat_script"]
