"""The report of the "variants" family (and the quant family built on it): tables against
MHA at the same S, timings, training, and the three plots."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from experiments.framework import report as report_lib
from experiments.framework import results

# Figures commonly quoted for GQA and MQA relative to MHA (cache size as a fraction of MHA's,
# decode speed as a multiple of MHA's). MLA is usually described as "adaptive": no number.
QUOTED: dict[str, dict[str, tuple[float, float]] | None] = {
    "GQA": {"cache": (0.25, 0.50), "speed": (1.8, 2.5)},
    "MQA": {"cache": (0.10, 0.20), "speed": (3.0, 5.0)},
    "MLA": None,
}

VARIANT_COLUMNS = ("variant", "K", "cache bytes/token", "cache vs MHA", "decode tok/s",
                   "speed vs MHA", "val bits/byte", "Δ vs MHA", "quoted range", "inside?")

PLOTS = {
    "decode": "decode_ms_per_step.png",
    "cache": "cache_bytes.png",
    "quality": "quality_vs_cache.png",
}


def variant_key(r: Mapping[str, Any]) -> str:
  """Legend name of a record's variant: "MHA K=8", "GQA K=2", "MLA"."""
  k = r.get("num_kv_heads")
  return r["variant"] if k is None else f"{r['variant']} K={k}"


def _inside(value: float, bounds: tuple[float, float]) -> str:
  return "yes" if bounds[0] <= value <= bounds[1] else "no"


def variant_rows(records: Sequence[Mapping[str, Any]]) -> dict[int, list[list[str]]]:
  """Rows of the comparison table, keyed by S, in the records' order.

  The MHA baseline of a row is the MHA record of the same S; without one the
  "vs MHA" cells read "n/a".
  """
  by_s: dict[int, list[Mapping[str, Any]]] = {}
  for r in records:
    by_s.setdefault(int(r["seq_len"]), []).append(r)
  out = {}
  for s in sorted(by_s):
    group = by_s[s]
    mha = next((r for r in group if r["variant"] == "MHA"), None)
    rows = []
    for r in group:
      cache = speed = delta = None
      if mha is not None:
        cache = r["cache_bytes_per_token"] / mha["cache_bytes_per_token"]
        speed = r["decode_tokens_per_s"] / mha["decode_tokens_per_s"]
        delta = r["validation_bits_per_byte"] - mha["validation_bits_per_byte"]
      quoted = QUOTED.get(r["variant"], None)
      if r["variant"] == "MHA":
        quoted_text, inside = "baseline", "—"
      elif r["variant"] == "MLA":
        quoted_text, inside = '"adaptive" (no number quoted)', "n/a"
      elif quoted is None:
        quoted_text, inside = "—", "—"
      else:
        quoted_text = (f"cache {quoted['cache'][0]:.0%}–{quoted['cache'][1]:.0%}, "
                       f"speed {quoted['speed'][0]:g}–{quoted['speed'][1]:g}×")
        inside = ("n/a (no MHA point)" if mha is None else
                  f"cache {_inside(cache, quoted['cache'])}, "
                  f"speed {_inside(speed, quoted['speed'])}")
      na = "n/a"
      rows.append([
          r["variant"],
          "—" if r.get("num_kv_heads") is None else str(r["num_kv_heads"]),
          f"{r['cache_bytes_per_token']:,}",
          na if cache is None else f"{cache:.1%}",
          f"{r['decode_tokens_per_s']:,.0f}",
          na if speed is None else f"{speed:.2f}×",
          f"{r['validation_bits_per_byte']:.3f}",
          na if delta is None else f"{delta:+.3f}",
          quoted_text,
          inside,
      ])
    out[s] = rows
  return out


def timing_rows(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
  """Per point: S, variant, cache MiB, prefill s and decode ms/step (median [min–max])."""
  rows = []
  for r in sorted(records, key=lambda r: (int(r["seq_len"]), 0)):
    rows.append([
        str(r["seq_len"]), variant_key(r), f"{r['cache_bytes'] / 2**20:,.2f}",
        f"{r['prefill_s']:.3f} [{r['prefill_s_min']:.3f}–{r['prefill_s_max']:.3f}]",
        f"{r['decode_ms_per_step']:.2f} [{r['decode_ms_per_step_min']:.2f}–"
        f"{r['decode_ms_per_step_max']:.2f}]",
        f"{r['decode_tokens_per_s_min']:,.0f}–{r['decode_tokens_per_s_max']:,.0f}",
        f"{r['load_avg_1min']:.1f}",
    ])
  return rows


def training_rows(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
  """One row per trained variant: steps, seconds, train loss, validation loss and bits/byte."""
  seen, rows = set(), []
  for r in records:
    if r["train_group"] in seen:
      continue
    seen.add(r["train_group"])
    rows.append([variant_key(r), str(r["train_steps"]), f"{r['train_seconds']:.1f}",
                 f"{r['train_loss']:.3f}", f"{r['validation_loss']:.3f}",
                 f"{r['validation_bits_per_byte']:.3f}"])
  return rows


def _lines(records):
  series: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
  for r in records:
    series.setdefault(variant_key(r), []).append((int(r["seq_len"]), r))
  return {k: sorted(v, key=lambda t: t[0]) for k, v in series.items()}


def plot_decode(records, path: str) -> None:
  """Decode ms/step vs S per variant (median; bars min–max)."""
  plt = report_lib.pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for name, pts in _lines(records).items():
    s = [p[0] for p in pts]
    med = [p[1]["decode_ms_per_step"] for p in pts]
    lo = [m - p[1]["decode_ms_per_step_min"] for m, p in zip(med, pts)]
    hi = [p[1]["decode_ms_per_step_max"] - m for m, p in zip(med, pts)]
    ax.errorbar(s, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("sequence length S (cache capacity, tokens)")
  ax.set_ylabel("decode ms / step (batch)")
  ax.set_title("Decode step time vs S")
  ax.grid(True, alpha=0.3)
  ax.legend()
  report_lib.save_figure(fig, path)


def plot_cache(records, path: str) -> None:
  """Measured cache bytes (all layers, whole batch) vs S per variant."""
  plt = report_lib.pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for name, pts in _lines(records).items():
    ax.plot([p[0] for p in pts], [p[1]["cache_bytes"] / 2**20 for p in pts], marker="o",
            label=name)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length S (tokens)")
  ax.set_ylabel("cache MiB (measured, all layers, batch)")
  ax.set_title("KV-cache size vs S")
  ax.grid(True, alpha=0.3, which="both")
  ax.legend()
  report_lib.save_figure(fig, path)


def plot_quality(records, path: str) -> None:
  """Validation bits/byte vs cache bytes/token, one marker per variant."""
  plt = report_lib.pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  seen = set()
  for r in records:
    if r["train_group"] in seen:
      continue
    seen.add(r["train_group"])
    x, y = r["cache_bytes_per_token"], r["validation_bits_per_byte"]
    ax.scatter([x], [y], s=40)
    ax.annotate(variant_key(r), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("cache bytes / token (all layers)")
  ax.set_ylabel("validation bits / byte (lower is better)")
  ax.set_title("Quality vs cache size")
  ax.grid(True, alpha=0.3)
  report_lib.save_figure(fig, path)


def _setup_lines(config: Mapping[str, Any] | None, records) -> list[str]:
  lines = []
  if config:
    m, t, c, dec = config["model"], config["train"], config["cache"], config["decode"]
    a = m["attention"]
    lines.append(
        f"Model: D = {m['d_model']}, L = {m['num_layers']}, F = {m['mlp_dim']}, N = "
        f"{a['num_heads']} query heads; GQA/MQA/MHA head width H = {a['head_dim']}; MLA C = "
        f"{a['kv_lora_rank']}, R = {a['qk_rope_head_dim']}, qk_nope = {a['qk_nope_head_dim']}, "
        f"v = {a['v_head_dim']}; compute {m['dtype']}, cache {c['dtype'] or m['dtype']} "
        f"(quantized caches store f32 per-token scales, counted in the cache bytes).")
    lines.append(
        f"Training per variant: {t['steps']} steps of batch {t['batch_size']} x "
        f"{config['data']['seq_len']} bytes (default corpus: CPython stdlib + pydoc topics), "
        f"shared across S. Decode: batch B = {c['batch']}, prompt of real validation text "
        f"filling the cache (S - {dec['new_tokens'] - 1}), {dec['new_tokens'] - 1} greedy "
        f"decode steps; {dec['warmup']} warm-up run, then medians of {dec['repeats']} timed "
        f"prefills and {dec['repeats'] * dec['decode_repeats']} timed decode loops.")
  if records:
    env = records[0]["environment"]
    loads = [r["load_avg_1min"] for r in records]
    lines.append(
        f"Machine: {records[0].get('cpu_model') or env['processor']} ({env['processor']}), "
        f"{env['cpu_count']} CPUs, {env['backend']} "
        f"({env['device_kind']}), JAX {env['jax_version']}, Python {env['python']}; 1-minute "
        f"load average during the points {min(loads):.1f}–{max(loads):.1f}.")
  return lines


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *,
                          title: str = "kvattn: attention variants compared",
                          config: Mapping[str, Any] | None = None) -> str:
  """Writes report.md and the PNG plots of a "variants" run into `workdir`; returns the markdown."""
  parts = [f"# {title}", ""]
  if not records:
    parts.append("No points measured yet.")
    markdown = "\n".join(parts) + "\n"
    results.atomic_write_text(os.path.join(workdir, "report.md"), markdown)
    return markdown
  parts += [" ".join(_setup_lines(config, records)), ""]
  parts += [
      "Ratios are against MHA at the same S in the same run: cache vs MHA = bytes/token ratio; "
      "speed vs MHA = decode tokens/s ratio (decode tok/s = B x steps / decode time, median); "
      "Δ vs MHA = validation bits/byte difference (negative is better). Cache bytes are read "
      "from the real cache arrays and equal the analytic figure (checked). The quoted ranges "
      "are the figures articles usually print; *inside?* says whether this run's measurement "
      "falls in them.", ""]
  for s, rows in variant_rows(records).items():
    parts += [f"## S = {s}", "", report_lib.markdown_table(VARIANT_COLUMNS, rows,
                                                ["l", "r", "r", "r", "r", "r", "r", "r", "l", "l"]),
              ""]
  parts += ["## Timings", "",
            report_lib.markdown_table(("S", "variant", "cache MiB", "prefill s [min–max]",
                            "decode ms/step [min–max]", "decode tok/s min–max", "load"),
                           timing_rows(records), ["r", "l", "r", "r", "r", "r", "r"]), ""]
  parts += ["## Training", "",
            report_lib.markdown_table(("variant", "steps", "seconds", "train loss", "val loss",
                            "val bits/byte"), training_rows(records)), ""]
  plot_decode(records, os.path.join(workdir, PLOTS["decode"]))
  plot_cache(records, os.path.join(workdir, PLOTS["cache"]))
  plot_quality(records, os.path.join(workdir, PLOTS["quality"]))
  parts += ["## Plots", "",
            f"![decode ms/step vs S]({PLOTS['decode']})",
            f"![cache bytes vs S]({PLOTS['cache']})",
            f"![quality vs cache size]({PLOTS['quality']})", ""]
  markdown = "\n".join(parts)
  results.atomic_write_text(os.path.join(workdir, "report.md"), markdown)
  return markdown
