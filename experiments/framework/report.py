"""Report helpers of the experiment families: markdown tables and PNG plots, written atomically.

Each family writes its own report (e.g. `experiments.families.variants.write_report`) with
these helpers.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Sequence

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


def write_report(workdir: str, text: str, records: Sequence[Any] = (),
                 plots: Callable[[str, Sequence[Any]], None] | None = None) -> str:
  """Writes `text` to `<workdir>/report.md` atomically, then `plots(workdir, records)` when
  there are records; returns `text`."""
  results.atomic_write_text(os.path.join(workdir, "report.md"), text)
  if records and plots is not None:
    plots(workdir, records)
  return text
