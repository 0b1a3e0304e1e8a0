"""RUN_DIR/metrics.jsonl: one JSON object per optimizer step (``"kind": "train"``) and per evaluation
(``"kind": "eval"``), appended and flushed as they happen, so a killed run keeps every finished row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dsv3.io import atomic_write_text


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every complete row; a torn last line (a killed writer) is dropped."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._file = None

    def truncate_after(self, step: int) -> None:
        """Keep only rows up to ``step``: a resumed run rewrites what came after its checkpoint."""
        if self.enabled and self.path.exists():
            kept = [r for r in read_rows(self.path) if r.get("step", 0) <= step]
            atomic_write_text(self.path, "".join(_dumps(r) + "\n" for r in kept))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(_dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _dumps(row: dict[str, Any]) -> str:
    """JSON with non-finite floats as null (JSON has no NaN)."""
    return json.dumps({k: _finite(v) for k, v in row.items()})


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v
