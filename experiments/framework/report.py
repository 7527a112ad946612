"""Report helpers of the experiment families: markdown tables and PNG plots, written atomically.

Each family writes its own report (e.g. `experiments.families.variants.write_report`) with
these helpers.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

from experiments.framework import results


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: Sequence[str] | None = None) -> str:
  """A GitHub markdown table; `align` per column: "l" or "r" (default: l for the first)."""
  align = align or ["l"] + ["r"] * (len(headers) - 1)
  rule = ["---:" if a == "r" else "---" for a in align]
  lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def save_figure(fig, path: str) -> None:
  """Writes a matplotlib figure as PNG atomically and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
  plt.close(fig)
  results.atomic_write_bytes(path, buf.getvalue())


def pyplot():
  """matplotlib.pyplot on the non-interactive Agg backend (imported on first use)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt
