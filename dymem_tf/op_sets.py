"""Op-type sets and op-name marks shared with the native code, read from their one definition,
``dymem_tf/cc/op_sets.h`` (which the C++ sources include as X-macros)."""
from __future__ import annotations

import functools
import re
from pathlib import Path

#: The definitions both sides read (installed with the package: ``cc/**/*.h`` is package data).
OP_SETS_PATH = Path(__file__).resolve().parent / "cc" / "op_sets.h"

_SET = re.compile(r"^DYMEM_OP_SET\((\w+),(.*?)\)\s*$", re.S | re.M)


@functools.cache
def op_sets() -> dict[str, tuple[str, ...]]:
    """Every set of :data:`OP_SETS_PATH` by its C++ name (``kStepInputTypes`` ...), entries in their order."""
    text = OP_SETS_PATH.read_text()
    found = {m.group(1): tuple(re.findall(r'"([^"]*)"', m.group(2))) for m in _SET.finditer(text)}
    if not found:
        raise RuntimeError(f"{OP_SETS_PATH} defines no op sets")
    return found


#: The step's input ops, whose outputs lead with the batch dimension.
STEP_INPUT_TYPES = frozenset(op_sets()["kStepInputTypes"])
#: Name scopes of a GradientTape's gradient ops.
GRADIENT_SCOPES = op_sets()["kGradientScopes"]
#: Prefixes of the op types that write a resource variable in place.
VARIABLE_UPDATE_PREFIXES = op_sets()["kVariableUpdatePrefixes"]
