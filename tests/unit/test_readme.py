"""The README's custom-env example runs as written."""
from __future__ import annotations

import re
from pathlib import Path

from lmcollect.collectors import LLMCollector
from lmcollect.data import keys
from lmcollect.testing import ScriptedPolicy

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if marker in b)


def test_custom_env_example_collects() -> None:
    namespace: dict = {}
    exec(readme_block("class EchoEnv"), namespace)  # noqa: S102 - our own README
    collector = LLMCollector(namespace["EchoEnv"](), policy=ScriptedPolicy("hi there"), dialog_turns_per_batch=4)
    batch = collector.next()
    assert batch.batch_size == (2, 2)
    assert batch[keys.NEXT_REWARD].flatten().tolist() == [1.0] * 4
    assert batch[keys.STEP_COUNT].flatten().tolist() == [0, 0, 0, 0]  # one-turn dialogs
