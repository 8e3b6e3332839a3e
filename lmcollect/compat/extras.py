"""Importing an adapter's library, which an optional extra installs."""

from __future__ import annotations

import importlib
from typing import Any


def import_extra(module: str, *, extra: str, who: str) -> Any:
    """``module`` imported, or an ImportError saying that ``who`` needs it and which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{who} need the {extra} package: pip install 'lmcollect[{extra}]'.") from exc
