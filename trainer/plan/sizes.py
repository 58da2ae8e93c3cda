"""Memory sizes as `dtrain plan --device-memory` reads them and as the plan and the launch checks
print them. No torch here: `dtrain plan` reads its arguments before torch loads."""

from __future__ import annotations

import re

from trainer.errors import UserError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str) -> int:
    """'80GiB', '80 GB', '81920MiB', '8e9' -> bytes. UserError when unparsable."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(
            f"cannot read memory size {text!r}; write a number with a unit, e.g. 80GiB, 40GB or 24000MiB"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not value > 0:
        raise UserError(f"memory size {text!r} must be positive")
    return int(value)


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
