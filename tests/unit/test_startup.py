"""lmcollect.startup: tensordict imported after lmcollect does not import torch's compiler, and
its compile marks still reach the compiler once something imports it."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.conftest import REPO_ROOT

CHECK = r"""
import json, sys
import lmcollect, tensordict
import tensordict.base, tensordict.utils
from lmcollect import startup
deferred = list(startup._pending)
report = {"compiler_imported": "torch._dynamo" in sys.modules, "deferred": len(deferred),
          "constant_marked": bool(getattr(tensordict.utils._lock_warn, "_dynamo_marked_constant", False))}
import torch
compiled = torch.compile(lambda x: x + 1, backend="eager")
compiled(torch.ones(2))
from torch._dynamo import trace_rules, variables
allowed = lambda fn: id(fn) in trace_rules._allowed_callable_ids or (
    trace_rules.lookup_callable(fn) == variables.TorchInGraphFunctionVariable)
report["all_allowed_after_compile"] = all(allowed(fn) for fn in deferred)
report["foreach_copy_allowed"] = allowed(tensordict.base._foreach_copy_compiled)
report["still_pending"] = len(startup._pending)
import torch.compiler
report["torch_compiler_restored"] = torch.compiler.allow_in_graph.__module__ == "torch.compiler"
print(json.dumps(report))
"""


def test_tensordict_after_lmcollect_skips_the_compiler_until_it_is_imported() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "compiler_imported": False,  # the ~2 s import did not happen
        "deferred": report["deferred"],
        "constant_marked": True,
        "all_allowed_after_compile": True,  # torch.compile sees tensordict's marks as before
        "foreach_copy_allowed": True,
        "still_pending": 0,
        "torch_compiler_restored": True,
    }
    assert report["deferred"] >= 1
