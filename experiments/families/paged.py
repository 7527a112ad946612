r"""Paged vs dense KV cache: memory reserved, used and wasted, and decode speed.

    python -m experiments.main --config=configs/paged.py --workdir=runs/paged
    python -m experiments.main --config=configs/paged.py:smoke --workdir=/tmp/paged

The "paged" experiment family of experiments/framework/runner.py (`experiment.kind =
"paged"`): the runner owns the bookkeeping (results.jsonl append-only, one
record per point, resumed by skipping finished points; results.csv; every file
written atomically), this module owns the points, the measurement and the
report. One point per `get_sweep()` entry of configs/paged.py: the dense cache
and the paged cache at each page size. Every point serves the same workload:

  * `workload.num_sequences` sequences whose final lengths L_b (prompt +
    new tokens - 1) are lognormal (median `workload.median_len`, shape
    `workload.sigma`) clipped to `[workload.min_len, cache.max_len]`: a
    long-tailed mix, as request lengths are in serving traces.
  * dense: `model.init_caches(B, cache.max_len)`, the contiguous
    per-request cache that must reserve the longest length for everyone.
    paged: `kvattn.caches.paged.init_paged_caches` with each sequence's own L_b,
    pages from a `PageAllocator` (shuffled free list), the pool exactly the
    pages handed out.

Measured per point (bytes read from the real arrays, `kvattn.memory`):

  * `bytes_reserved`: the caches' key/value storage, all layers;
    `bytes_used`: `sum_b L_b * bytes_per_token`; `waste_fraction = 1 -
    used / reserved` (dense: unused capacity; paged: the unused tail of each
    sequence's last page, also reported by the allocator);
  * `sequences_at_dense_budget`: how many sequences of a longer stream from the
    same distribution a paged pool of the dense cache's size admits (the
    allocator's `OutOfPagesError` ends the count); the dense cache admits B;
  * decode: `kvattn.generate`'s compiled prefill and decode loop over the B
    sequences (prompts of L_b - new_tokens + 1 random tokens, right-padded),
    `decode.warmup` untimed runs then `decode.repeats` timed ones;
    `decode_tokens_per_s = B * (new_tokens - 1) / decode_s`. The caches must
    end holding exactly L_b tokens per sequence.

The report (report.md), the waste figures (waste.md, waste.json) and the plot
(paged_waste.png) compare every point with the dense point of the same run and
state the measured waste next to Kwon et al.'s figures (SOSP 2023: 60-80% of KV
memory wasted by contiguous caches, under 4% with paging).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.framework import report as report_lib
from experiments.framework import results
from experiments.framework import runner
from experiments.framework import overrides
from experiments.framework import checks
from experiments.framework import timing
from kvattn import memory
from kvattn.paging import allocator as allocator_lib
from kvattn.caches import paged as cache_factories
from kvattn.models import transformer as transformer_lib

# Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention", SOSP 2023 (abstract and §1): existing systems waste 60-80% of the KV cache
# memory; vLLM's paging keeps the waste under 4%.
PAPER = {"contiguous_waste": (0.60, 0.80), "paged_waste_max": 0.04,
         "source": "Kwon et al., SOSP 2023 (PagedAttention)"}

CACHE_KINDS = ("dense", "paged")  # the kinds this family measures
FILES = {"waste_md": "waste.md", "waste_json": "waste.json", "plot": "paged_waste.png"}


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "paged" config (see configs/paged.py for each field)."""
  return {
      "model": tuple(overrides.flat_keys(transformer_lib.model_config().to_dict())),
      "cache": ("kind", "page_size", "max_len", "dtype", "seed"),
      "workload": ("num_sequences", "median_len", "sigma", "min_len", "budget_sequences", "seed"),
      "decode": ("new_tokens", "warmup", "repeats"),
      "experiment": ("kind", "name", "max_points"),
  }



def draw_lengths(workload: Mapping[str, Any], max_len: int, count: int, seed_offset: int = 0
                 ) -> np.ndarray:
  """`i32[count]` final lengths: lognormal(log median, sigma), rounded, clipped to
  `[min_len, max_len]` (the long tail piles a few sequences at `max_len`)."""
  rng = np.random.default_rng(workload["seed"] + seed_offset)
  raw = np.exp(rng.normal(np.log(workload["median_len"]), workload["sigma"], count))
  return np.clip(np.round(raw), workload["min_len"], max_len).astype(np.int32)


class PagedFamily:
  """Dense vs paged caches on one long-tailed workload (module doc)."""

  kind = "paged"

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.schema = schema()
    self._title = "kvattn: paged vs dense KV cache"
    self._config: dict[str, Any] | None = None
    self._model: tuple[str, nnx.Module] | None = None
    self._preflighted: set[tuple[Any, ...]] = set()

  # -- points and validation -------------------------------------------------------------------

  def _check(self, d: Mapping[str, Any], where: str) -> transformer_lib.ModelSpec:
    """Validates one point config; returns its ModelSpec (ValueError naming the key)."""
    spec = checks.model_spec(d, where)
    if any(layer.kind != "gqa" for layer in spec.layers):
      raise ValueError(f"{where}: model.attention.kind must be 'gqa' (paged caches hold K-head "
                       f"keys and values); got {d['model']['attention']['kind']!r}")
    cache, work, dec = d["cache"], d["workload"], d["decode"]
    if cache["kind"] not in CACHE_KINDS:
      raise ValueError(f"{where}: cache.kind must be one of {CACHE_KINDS}; got {cache['kind']!r}")
    checks.check_int(f"{where}: cache.page_size", cache["page_size"])
    max_len = checks.check_int(f"{where}: cache.max_len", cache["max_len"])
    checks.check_int(f"{where}: cache.seed", cache["seed"], 0)
    if cache["dtype"] is not None:
      try:
        if not jnp.issubdtype(jnp.dtype(cache["dtype"]), jnp.floating):
          raise TypeError
      except TypeError:
        raise ValueError(f"{where}: cache.dtype must name a floating dtype or be None; got "
                         f"{cache['dtype']!r}") from None
    checks.check_int(f"{where}: workload.num_sequences", work["num_sequences"])
    new_tokens = checks.check_int(f"{where}: decode.new_tokens", dec["new_tokens"], 2)
    # Every prompt needs at least one token.
    min_len = checks.check_int(f"{where}: workload.min_len", work["min_len"], new_tokens)
    if min_len > max_len:
      raise ValueError(f"{where}: workload.min_len must be <= cache.max_len = {max_len}; got "
                       f"{min_len}")
    median = work["median_len"]
    if isinstance(median, bool) or not isinstance(median, (int, float)) or median <= 0:
      raise ValueError(f"{where}: workload.median_len must be a positive number; got {median!r}")
    sigma = work["sigma"]
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or sigma < 0:
      raise ValueError(f"{where}: workload.sigma must be a number >= 0; got {sigma!r}")
    checks.check_int(f"{where}: workload.budget_sequences", work["budget_sequences"])
    checks.check_int(f"{where}: workload.seed", work["seed"], 0)
    checks.check_int(f"{where}: decode.warmup", dec["warmup"], 0)
    checks.check_int(f"{where}: decode.repeats", dec["repeats"], 1)
    return spec

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """One point per sweep entry; all validated before any work.

    Raises:
      ValueError: unknown section/key, bad value or duplicate point, naming the key.
    """
    base = overrides.to_dict(config)
    overrides.check_schema(base, self.schema)
    self._check(base, "config")  # the config as given (command-line overrides included)
    self._config = base
    self._title = base["experiment"]["name"] or self._title

    def point_of(d, where):
      spec = self._check(d, where)
      cache = d["cache"]
      paged = cache["kind"] == "paged"
      measured = {s: d[s] for s in ("model", "workload", "decode")}
      # The page size and allocator seed do not change a dense point.
      measured["cache"] = {k: v for k, v in cache.items()
                           if paged or k not in ("page_size", "seed")}
      return runner.PointSpec(
          f"paged-P{cache['page_size']}" if paged else "dense", measured,
          overrides.digest(d["model"], 12), {
              "cache_kind": cache["kind"], "page_size": cache["page_size"] if paged else None,
              "max_len": cache["max_len"], "num_sequences": d["workload"]["num_sequences"],
              "num_kv_heads": spec.layers[0].num_kv_heads, "head_dim": spec.layers[0].head_dim,
              "num_layers": spec.num_layers})

    return runner.expand_points(config, sweep, point_of)

  def preflight(self, point: runner.Point) -> None:
    """Traces one decode step of the point's model against the caches `measure` builds
    (paged: the pool for the workload's lengths; and the dense cache, which every point
    decodes through), abstractly (`checks.check_decode_step`), before any work."""
    d = point.config
    spec = transformer_lib.resolve_config(d["model"])
    cache_cfg, work = d["cache"], d["workload"]
    batch, max_len = work["num_sequences"], cache_cfg["max_len"]
    dtype = jnp.dtype(cache_cfg["dtype"] or d["model"]["dtype"])
    final = draw_lengths(work, max_len, batch).tolist()
    builders = {("dense", repr(spec), batch, max_len, str(dtype)):
                lambda model: model.init_caches(batch, max_len, dtype)}
    if cache_cfg["kind"] == "paged":
      builders[("paged", repr(spec), tuple(final), cache_cfg["page_size"], max_len,
                str(dtype))] = lambda model: cache_factories.init_paged_caches(
                    model, final, page_size=cache_cfg["page_size"], max_len=max_len,
                    dtype=dtype)[0]
    for key, build in builders.items():
      if key not in self._preflighted:
        checks.check_decode_step(spec, build, batch,
                                 implementation=d["model"]["attention"]["decode_implementation"],
                                 where=f"{point.label} ({key[0]} cache)")
        self._preflighted.add(key)

  # -- measurement ----------------------------------------------------------------------------

  def model(self, point: runner.Point) -> nnx.Module:
    """The point's model with random weights (seed 0), built once per model config."""
    if self._model is None or self._model[0] != point.group:
      spec = transformer_lib.resolve_config(point.config["model"])
      self._model = (point.group, transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)))
    return self._model[1]

  def measure(self, point: runner.Point) -> dict[str, Any]:
    d = point.config
    cache_cfg, work, dec = d["cache"], d["workload"], d["decode"]
    model = self.model(point)
    spec = model.spec
    batch, max_len, new_tokens = work["num_sequences"], cache_cfg["max_len"], dec["new_tokens"]
    paged = cache_cfg["kind"] == "paged"
    page_size = cache_cfg["page_size"]
    cache_dtype = jnp.dtype(cache_cfg["dtype"] or d["model"]["dtype"])
    final = draw_lengths(work, max_len, batch)  # L_b: tokens cached at the end
    prompt_lengths = final - (new_tokens - 1)
    width = int(prompt_lengths.max())
    rng = np.random.default_rng(work["seed"] + 1)
    prompts = np.zeros((batch, width), np.int32)
    for b, n in enumerate(prompt_lengths):
      prompts[b, :n] = rng.integers(0, 256, n)
    analytic = transformer_lib.cache_bytes_per_token(spec, cache_dtype)

    def build():
      if paged:
        return cache_factories.init_paged_caches(model, final.tolist(), page_size=page_size,
                                                 max_len=max_len, dtype=cache_dtype,
                                                 seed=cache_cfg["seed"])
      return model.init_caches(batch, max_len, cache_dtype), None

    caches, allocator = build()
    per_token = sum(memory.measured_bytes_per_token(c) for c in caches)
    if per_token != analytic:
      raise checks.CacheAccountingError(
          f"{point.label}: {per_token} bytes/token measured vs {analytic} analytic")
    reserved = int(sum(memory.tree_bytes(c.storage_arrays()) for c in caches))
    used = int(final.sum()) * int(analytic)
    record: dict[str, Any] = {
        "bytes_per_token": int(analytic),
        "bytes_reserved": reserved,
        "bytes_used": used,
        "waste_fraction": 1.0 - used / reserved,
        "bookkeeping_bytes": int(memory.tree_bytes(list(caches))) - reserved,
        "tokens": int(final.sum()),
        "final_lengths": final.tolist(),
        "length_mean": float(final.mean()),
        "length_median": float(np.median(final)),
        "length_max": int(final.max()),
    }
    dense_budget = batch * max_len * int(analytic)
    if paged:
      stats = allocator.stats()
      if stats.reserved_slots * analytic != reserved:
        raise checks.CacheAccountingError(
            f"{point.label}: allocator reserves {stats.reserved_slots} slots but the pools hold "
            f"{reserved // analytic}")
      record.update(pages=stats.used_pages, internal_waste_fraction=stats.waste_fraction)
      record["sequences_at_dense_budget"] = self._fit_at_budget(d, dense_budget, analytic)
    else:
      record.update(pages=None, internal_waste_fraction=None, sequences_at_dense_budget=batch)
    del caches

    # Decode timing: fresh caches each run (prefill and decode donate them). A paged point
    # also times the dense cache, alternating run by run, so its speed ratio is measured under
    # the same machine load (other processes share the CPU).
    builders = {"self": build}
    if paged:
      builders["dense"] = lambda: (model.init_caches(batch, max_len, cache_dtype), None)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in builders}
    for i in range(dec["warmup"] + dec["repeats"]):
      for name in (list(builders) if i % 2 == 0 else list(builders)[::-1]):
        caches, _ = builders[name]()
        prefill_s, first, caches, key = timing.timed_prefill(model, prompts, prompt_lengths,
                                                             caches)
        decode_s, decode_cpu_s, _, _, caches = timing.timed_decode(model, first, caches,
                                                                   new_tokens, key)
        seconds = (prefill_s, decode_s, decode_cpu_s)
        filled = [np.asarray(c.lengths).tolist() for c in caches]
        if i >= dec["warmup"]:
          times[name].append(seconds)
        if any(f != final.tolist() for f in filled):
          raise RuntimeError(f"{point.label} ({name}): caches hold {filled[0]} tokens after "
                             f"decoding, expected {final.tolist()}")
    steps = new_tokens - 1
    tokens_per_s = {name: [batch * steps / t[1] for t in ts] for name, ts in times.items()}
    own = tokens_per_s["self"]
    record.update({
        "decode_backends": list(_backends(paged)),
        "decode_implementation": d["model"]["attention"]["decode_implementation"],
        "new_tokens": new_tokens, "decode_steps": steps,
        "prefill_s": statistics.median(t[0] for t in times["self"]),
        "decode_s": statistics.median(t[1] for t in times["self"]),
        "decode_ms_per_step": 1000.0 * statistics.median(t[1] for t in times["self"]) / steps,
        "decode_tokens_per_s": statistics.median(own),
        "decode_tokens_per_s_min": min(own),
        "decode_tokens_per_s_max": max(own),
        "dense_decode_tokens_per_s_interleaved": (statistics.median(tokens_per_s["dense"])
                                                  if paged else None),
        # Median over the interleaved pairs of (paged / dense) tokens/s: each pair ran back to
        # back under the same load, and the median drops the pairs a load spike hit.
        "speed_vs_dense": (statistics.median(a / b for a, b in zip(own, tokens_per_s["dense"]))
                           if paged else 1.0),
        "speed_vs_dense_best": max(own) / max(tokens_per_s["dense"]) if paged else 1.0,
        "decode_cpu_s": statistics.median(t[2] for t in times["self"]),
        # Dense / paged CPU seconds of the decode loop, median over the same pairs.
        "cpu_work_vs_dense": (statistics.median(
            b[2] / a[2] for a, b in zip(times["self"], times["dense"])) if paged else 1.0),
    })
    return record

  def _fit_at_budget(self, d: Mapping[str, Any], budget_bytes: int, bytes_per_token: int) -> int:
    """Sequences of a stream from the workload's distribution that a paged pool of
    `budget_bytes` admits, in order, until the allocator refuses one."""
    cache, work = d["cache"], d["workload"]
    pages = budget_bytes // (cache["page_size"] * bytes_per_token)
    pps = allocator_lib.pages_for(cache["max_len"], cache["page_size"])
    alloc = allocator_lib.PageAllocator(max(1, pages), cache["page_size"], pps)
    stream = draw_lengths(work, cache["max_len"], work["budget_sequences"], seed_offset=2)
    for i, length in enumerate(stream):
      try:
        alloc.allocate(i, int(length))
      except allocator_lib.OutOfPagesError:
        return i
    raise ValueError(f"workload.budget_sequences = {work['budget_sequences']} all fit in the "
                     f"dense cache's memory; raise it to measure the paged capacity")

  # -- report ---------------------------------------------------------------------------------

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    return write_report(self.workdir, records, title=self._title, config=self._config)


def _backends(paged: bool) -> tuple[str, ...]:
  from kvattn import ops  # pylint: disable=g-import-not-at-top
  return ops.available_implementations("paged_decode_attention" if paged else "decode_attention")


runner.register_family("paged", PagedFamily)


# ----------------------------------------------------------------------------------------------
# Report.


def _mib(n: float) -> str:
  return f"{n / 2**20:.2f}"


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def waste_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Measured waste per point next to the paper's figures (JSON-able)."""
  dense = [r for r in records if r["cache_kind"] == "dense"]
  paged = sorted((r for r in records if r["cache_kind"] == "paged"), key=lambda r: r["page_size"])
  out: dict[str, Any] = {"paper": PAPER, "dense": None, "paged": []}
  if dense:
    w = dense[0]["waste_fraction"]
    lo, hi = PAPER["contiguous_waste"]
    out["dense"] = {"waste_fraction": w, "inside_paper_range": lo <= w <= hi,
                    "bytes_reserved": dense[0]["bytes_reserved"],
                    "bytes_used": dense[0]["bytes_used"]}
  for r in paged:
    out["paged"].append({"page_size": r["page_size"], "waste_fraction": r["waste_fraction"],
                         "below_paper_bound": r["waste_fraction"] < PAPER["paged_waste_max"],
                         "bytes_reserved": r["bytes_reserved"], "bytes_used": r["bytes_used"]})
  return out


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str,
                 config: Mapping[str, Any] | None = None) -> str:
  """Writes report.md, waste.md, waste.json and paged_waste.png atomically; returns report.md."""
  records = list(records)
  dense = next((r for r in records if r["cache_kind"] == "dense"), None)
  rows = []
  for r in records:
    speed = f"{r['speed_vs_dense']:.2f}x"
    reserved = (f"{r['bytes_reserved'] / dense['bytes_reserved']:.3f}" if dense else "n/a")
    rows.append([
        r["cache_kind"], r["page_size"] or "-", _mib(r["bytes_reserved"]), _mib(r["bytes_used"]),
        _pct(r["waste_fraction"]), reserved, r["sequences_at_dense_budget"],
        f"{r['decode_tokens_per_s']:.0f}", speed, f"{r['cpu_work_vs_dense']:.2f}x"])
  table = report_lib.markdown_table(
      ["cache", "page size", "reserved MiB", "used MiB", "waste", "reserved vs dense",
       "sequences in dense memory", "decode tok/s", "speed vs dense", "dense / paged CPU s"],
      rows)
  figures = waste_figures(records)
  waste_md = _waste_markdown(figures)
  lines = [f"# {title}", ""]
  if records:
    r0 = records[0]
    lines += [
        f"Workload: {r0['num_sequences']} sequences, final lengths lognormal (median "
        f"{r0['length_median']:.0f}, mean {r0['length_mean']:.1f}, max {r0['length_max']} "
        f"tokens), cache.max_len = {r0['max_len']}; {r0['num_layers']} layers, K = "
        f"{r0['num_kv_heads']}, H = {r0['head_dim']}, {r0['bytes_per_token']} cache bytes per "
        f"token. Decode: {r0['decode_steps']} steps through kvattn.generate; backends tried in "
        f"order: dense {_backends(False)}, paged {_backends(True)}. Memory ratios are against the "
        f"dense point of this run; `speed vs dense` is the median, over back-to-back pairs of "
        f"runs, "
        f"of paged / dense decode tokens/s (the dense cache is timed alternately with each paged "
        f"point). `dense / paged CPU s`: CPU seconds of the decode loop (all threads), dense over "
        f"paged, median over the same pairs -- the work ratio, which other processes on a shared "
        f"machine inflate less than wall time. `decode tok/s` is the median of the point's own "
        f"runs. Machine: {r0['environment']['device_kind']} "
        f"({r0['environment']['cpu_count']} CPUs), JAX {r0['environment']['jax_version']}, "
        f"1-minute load average {min(r.get('load_avg_1min', 0) for r in records):.1f}-"
        f"{max(r.get('load_avg_1min', 0) for r in records):.1f} while measuring.", ""]
  lines += [table, "", waste_md, "",
            "`sequences in dense memory`: sequences of a longer stream from the same distribution "
            "that the cache admits in the dense cache's bytes (paged: until the allocator "
            "refuses one).", "", f"![waste]({FILES['plot']})", ""]
  markdown = "\n".join(lines)
  results.atomic_write_text(os.path.join(workdir, "report.md"), markdown)
  results.atomic_write_text(os.path.join(workdir, FILES["waste_md"]), waste_md + "\n")
  results.atomic_write_text(os.path.join(workdir, FILES["waste_json"]),
                            json.dumps(figures, indent=2, sort_keys=True) + "\n")
  if records:
    _plot(records, os.path.join(workdir, FILES["plot"]))
  return markdown


def _waste_markdown(figures: Mapping[str, Any]) -> str:
  lo, hi = PAPER["contiguous_waste"]
  lines = ["## Waste: measured vs the PagedAttention paper", ""]
  rows = []
  if figures["dense"]:
    w = figures["dense"]["waste_fraction"]
    rows.append(["dense (contiguous, capacity = max length)", _pct(w),
                 f"{_pct(lo)}-{_pct(hi)}", "yes" if lo <= w <= hi else "no"])
  for p in figures["paged"]:
    rows.append([f"paged, page size {p['page_size']}", _pct(p["waste_fraction"]),
                 f"< {_pct(PAPER['paged_waste_max'])}", "yes" if p["below_paper_bound"] else "no"])
  lines.append(report_lib.markdown_table(["cache", "measured waste", "paper", "inside?"], rows))
  lines += ["", f"Paper: {PAPER['source']} — contiguous per-request caches waste "
            f"{_pct(lo)}-{_pct(hi)} of KV memory; paging keeps it under "
            f"{_pct(PAPER['paged_waste_max'])}. Here waste = 1 - bytes used / bytes reserved, "
            "both read from the cache arrays. Paged waste is the unused tail of each sequence's "
            "last page, about (page_size - 1) / 2 tokens per sequence, so it grows with the page "
            "size and shrinks with the mean length (the paper's traces average a few hundred "
            "tokens per request)."]
  return "\n".join(lines)


def _plot(records, path: str) -> None:
  plt = report_lib.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  paged = sorted((r for r in records if r["cache_kind"] == "paged"), key=lambda r: r["page_size"])
  dense = [r for r in records if r["cache_kind"] == "dense"]
  if paged:
    ax1.plot([r["page_size"] for r in paged], [100 * r["waste_fraction"] for r in paged], "o-",
             label="paged (measured)")
    ax1.set_xscale("log", base=2)
  for r in dense:
    ax1.axhline(100 * r["waste_fraction"], color="C3", label="dense (measured)")
  lo, hi = PAPER["contiguous_waste"]
  ax1.axhspan(100 * lo, 100 * hi, color="C3", alpha=0.12, label="paper: contiguous")
  ax1.axhline(100 * PAPER["paged_waste_max"], color="C2", ls="--", label="paper: paged bound")
  ax1.set_xlabel("page size (tokens)")
  ax1.set_ylabel("KV memory wasted (%)")
  ax1.legend(fontsize=7)
  names = [r["label"] for r in records]
  ax2.bar(names, [r["decode_tokens_per_s"] for r in records], color="C0")
  ax2.set_ylabel("decode tokens/s")
  ax2.tick_params(axis="x", rotation=45, labelsize=7)
  fig.suptitle("paged vs dense KV cache")
  fig.subplots_adjust(wspace=0.35)
  report_lib.save_figure(fig, path)
