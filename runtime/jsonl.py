"""JSON that strict parsers read: no bare NaN or Infinity in the files a run writes.

Python's json module writes float("nan") as `NaN` and infinities as `Infinity`, which JSON does not have:
jq, JavaScript, Go and other strict parsers reject the whole line. `dumps(value)` leaves out every
dictionary key whose value is a non-finite float (readers take `line.get(key, default)`, as for a key a
line does not log) and writes null for one inside a list; `finite(value)` is that cleaning alone.
"""

from __future__ import annotations

import json
import math


def finite(value):
    """`value` with non-finite floats dropped from dicts and made None in lists (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items() if not _non_finite(v)}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """`json.dumps` of `finite(value)`; strict (allow_nan=False) so that nothing non-finite gets through."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def _non_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)
