r"""KV caches below 8 bits (KIVI, rotated codebook) next to the dense f32 / bf16 / int8 caches on a real model.

    python -m experiments.main --config=configs/lowbit.py --workdir=runs/lowbit

The "lowbit" family of experiments/framework/runner.py (`experiment.kind = "lowbit"`). One
point per sweep entry of configs/lowbit.py: a cache spec (`cache.kind` of
`kvattn.caches.registry`, `cache.dtype`, and the options of KIVI (`group_size`, `residual`,
`pre_rope`) or of the rotated kinds (`residual`, `codebook`)).
Measured per point, batch 1, on `model.name`:

  * cache bytes per token from the real arrays (`kvattn.memory.measured_bytes_per_token`,
    everything a KIVI cache stores: packed codes, scales, zero points, the residual ring)
    at a capacity of `text.num_tokens + text.new_tokens` tokens, checked against the kind's
    analytic count (`analytic_bytes_per_token` for KIVI, `kvattn.memory` for dense);
  * perplexity of `text.num_tokens` held-out tokens streamed `text.chunk` per forward pass
    (`experiments.evals.streaming.streaming_nll`);
  * from that cache, `text.new_tokens` greedy tokens through `kvattn.generate`'s compiled
    decode loop (`timing.timed_decode`, caches donated; a first run on a copy compiles):
    decode tokens/s at that context and the tokens, whose agreement with the f32 dense
    point's the report computes;
  * passkey retrieval (`streaming.passkey_correct`) at `passkey.context` tokens.

The speed point (`cache.kind = "speed"`, configs/lowbit.py:speed): every cache of
`speed.caches` ("dense:<dtype>" or a low-bit kind with its registry defaults) is filled with
the same `speed.batch` rows of `speed.prompt` held-out tokens (`text.chunk` per forward
pass), then decoded greedily through `kvattn.generate`'s compiled decode loop
(`timing.decode_rounds`) in `speed.repeats` interleaved rounds of `speed.steps` steps (the
first, untimed round compiles; the order rotates every round), all in this process. Per
round the step times become ratios to the int8 and the f32 dense caches' of the same round;
the report gives their medians (ratios measured side by side survive a shared machine where
absolute times do not), with decode tokens/s (`batch / step time`) and the greedy agreement
with the f32 cache's decoded tokens.

The peer step (`peers.run`, off by default): after the points, HF transformers'
`QuantizedCache` (quanto backend, `peers.bits`, `residual_length = peers.residual`) and its
f32 `DynamicCache` stream the same `text.num_tokens` tokens `text.chunk` per forward pass in a
subprocess of `peers.python` (experiments/benchmarks/peers/hf_quantized_cache.py): perplexity,
bytes per token read from its tensors, and `text.new_tokens` greedy tokens (decode tok/s).
The results are kept in `<workdir>/peers.json` (keyed by the request: a rerun reuses them) and
join report.md's table (agreement against our f32 point's tokens; no passkey).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import tempfile
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.framework import checks
from experiments.framework import overrides
from experiments.framework import report as report_lib
from experiments.framework import results
from experiments.framework import runner
from experiments.framework import timing
from experiments.evals import models
from experiments.evals import streaming
from experiments.evals import text as text_lib
from kvattn import memory
from kvattn.caches import registry as cache_registry

KIVI_OPTIONS = ("group_size", "residual", "pre_rope", "codebook")
"""The options of the low-bit kinds a config's `cache` section may set (None: the kind's
default): KIVI's `group_size`, `residual`, `pre_rope`; the rotated kinds' `residual`,
`codebook`."""


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "lowbit" config (configs/lowbit.py documents each)."""
  return {
      "model": ("name", "dtype"),
      "cache": ("kind", "dtype") + KIVI_OPTIONS,
      "text": ("num_tokens", "chunk", "new_tokens"),
      "passkey": ("context", "samples", "new_tokens", "seed"),
      "peers": ("run", "python", "threads", "bits", "residual", "q_group_size"),
      "speed": ("batch", "prompt", "steps", "repeats", "caches"),
      "experiment": ("kind", "name", "max_points"),
  }


def cache_spec(cache: Mapping[str, Any]) -> dict[str, Any]:
  """The registry spec of a config's `cache` section (None options: the kind's defaults)."""
  return {"kind": cache["kind"], **{k: cache[k] for k in KIVI_OPTIONS if cache[k] is not None}}


def speed_spec(entry: str) -> tuple[dict[str, Any], str | None]:
  """`(registry spec, dense storage dtype or None)` of a `speed.caches` entry: "dense:<dtype>"
  or a low-bit kind name (its registry defaults). ValueError for anything else."""
  kind, _, dtype = entry.partition(":")
  if kind == "dense":
    if not dtype:
      raise ValueError(f"speed.caches: a dense entry needs its dtype, 'dense:<dtype>'; got "
                       f"{entry!r}")
    return {"kind": "dense"}, dtype
  if dtype:
    raise ValueError(f"speed.caches: only dense entries take a dtype; got {entry!r}")
  cache_registry.cache_options({"kind": kind}, "speed.caches")
  return {"kind": kind}, None


def _label(cache: Mapping[str, Any]) -> str:
  if cache["kind"] == "speed":
    return "speed"
  if cache["kind"] == "dense":
    return f"dense-{cache['dtype']}"
  spec = cache_registry.cache_options(cache_spec(cache))[1]
  if cache["kind"].startswith("rotated"):
    book = spec["codebook"] if isinstance(spec["codebook"], str) else "fitted"
    return f"{cache['kind']}-r{spec['residual']}-{book}"
  return (f"{cache['kind']}-g{spec['group_size']}-r{spec['residual']}"
          + ("-prerope" if spec["pre_rope"] else ""))


def _is_reference(cache: Mapping[str, Any]) -> bool:
  return cache["kind"] == "dense" and cache["dtype"] == "float32"


class LowbitFamily:
  """The "lowbit" family (module doc)."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self._model: dict[tuple[str, str], Any] = {}
    self._title = "kvattn: KV caches below 8 bits"
    self._peers: Mapping[str, Any] = {"run": False}

  def _check(self, d: Mapping[str, Any], where: str) -> None:
    cache, text = d["cache"], d["text"]
    if cache["kind"] == "speed":
      sp = d["speed"]
      for key, least in (("batch", 1), ("prompt", 1), ("steps", 1), ("repeats", 1)):
        checks.check_int(f"{where}: speed.{key}", sp[key], least)
      checks.check_int(f"{where}: text.chunk", text["chunk"], 1)
      if not sp["caches"]:
        raise ValueError(f"{where}: speed.caches must name at least one cache")
      for entry in sp["caches"]:
        spec, dtype = speed_spec(entry)
        if dtype is not None:
          jnp.dtype(dtype)
      return
    if cache["kind"] == "dense" and any(cache[k] is not None for k in KIVI_OPTIONS):
      raise ValueError(f"{where}: cache.{'/'.join(KIVI_OPTIONS)} apply to the low-bit kinds "
                       f"only; got cache.kind = 'dense'")
    cache_registry.cache_options(cache_spec(cache), f"{where}: cache")
    checks.check_int(f"{where}: text.num_tokens", text["num_tokens"], 1)
    checks.check_int(f"{where}: text.chunk", text["chunk"], 1)
    checks.check_int(f"{where}: text.new_tokens", text["new_tokens"], 2)
    checks.check_int(f"{where}: passkey.context", d["passkey"]["context"], 32)
    checks.check_int(f"{where}: passkey.samples", d["passkey"]["samples"], 1)

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """One point per sweep entry, all validated before any work (ValueError naming the key)."""
    base = overrides.to_dict(config)
    overrides.check_schema(base, schema())
    self._title = base["experiment"]["name"] or self._title
    self._peers = base["peers"]
    if self._peers["run"]:
      checks.check_int("peers.threads", self._peers["threads"], 1)
      checks.check_int("peers.residual", self._peers["residual"], 0)
      checks.check_int("peers.q_group_size", self._peers["q_group_size"], 1)
      if not self._peers["bits"] or any(b not in (2, 4) for b in self._peers["bits"]):
        raise ValueError(f"peers.bits must list 2 and / or 4 (quanto's); got "
                         f"{self._peers['bits']!r}")

    def point_of(d, where):
      self._check(d, where)
      if d["cache"]["kind"] == "speed":
        measured = {"model": d["model"], "speed": d["speed"], "chunk": d["text"]["chunk"]}
        return runner.PointSpec("speed", measured, d["model"]["name"], {
            "kind": "speed", "cache_dtype": None, "reference": False})
      measured = {s: d[s] for s in ("model", "cache", "text", "passkey")}
      # `codebook` joined the section later: left out when unset, so earlier points keep ids.
      measured["cache"] = {k: v for k, v in d["cache"].items()
                           if k != "codebook" or v is not None}
      return runner.PointSpec(_label(d["cache"]), measured, d["model"]["name"], {
          "kind": d["cache"]["kind"], "cache_dtype": d["cache"]["dtype"],
          "reference": _is_reference(d["cache"])})

    return runner.expand_points(config, sweep, point_of)

  def model(self, d: Mapping[str, Any]):
    key = (d["model"]["name"], d["model"]["dtype"])
    if key not in self._model:
      self._model = {key: models.load_model(*key)}
    return self._model[key]

  def measure(self, point: runner.Point) -> dict[str, Any]:
    cpu_start = time.process_time()
    d = point.config
    if d["cache"]["kind"] == "speed":
      return {**self._speed(d), "point_cpu_s": time.process_time() - cpu_start}
    model, tokenizer = self.model(d)
    text, spec = d["text"], cache_spec(d["cache"])
    dtype = jnp.dtype(d["cache"]["dtype"])
    n, new = text["num_tokens"], text["new_tokens"]
    ids = text_lib.held_out_tokens(tokenizer, n + 1)
    capacity = n + new
    caches = model.init_caches(1, capacity, dtype, cache=spec)
    per_token = sum(memory.measured_bytes_per_token(c) for c in caches)
    attn = model.layers[0].attn
    if hasattr(caches[0], "analytic_bytes_per_token"):
      analytic = sum(c.analytic_bytes_per_token() for c in caches)
    else:
      analytic = model.num_layers * memory.gqa_bytes_per_token(attn.num_kv_heads, attn.head_dim,
                                                               dtype)
    if not math.isclose(per_token, analytic, rel_tol=1e-9):
      raise checks.CacheAccountingError(
          f"{point.id}: measured {per_token} bytes per token, analytic {analytic}")
    f32_bytes = model.num_layers * memory.gqa_bytes_per_token(attn.num_kv_heads, attn.head_dim,
                                                              jnp.float32)
    start = time.perf_counter()
    nll, caches = streaming.streaming_nll(model, caches, ids, text["chunk"])
    ppl_s = time.perf_counter() - start
    # Greedy continuation from the streamed cache: the next held-out token first.
    first = jnp.asarray([int(ids[n])], jnp.int32)
    timing.timed_decode(model, first, jax.tree.map(jnp.copy, caches), new,
                        jax.random.key(0))  # compiles
    seconds, _, tokens, _, _ = timing.timed_decode(model, first, caches, new, jax.random.key(0))
    passkey = d["passkey"]
    prompts, lengths, keys = text_lib.passkey_prompts(tokenizer, passkey["context"],
                                                      passkey["samples"], passkey["seed"])
    rows = [prompts[b, :lengths[b]].tolist() for b in range(len(keys))]
    found = streaming.passkey_correct(
        model, lambda b, c: model.init_caches(b, c, dtype, cache=spec), rows, keys,
        text["chunk"], passkey["new_tokens"], tokenizer)
    return {
        "num_layers": int(model.num_layers),
        "num_kv_heads": int(attn.num_kv_heads),
        "head_dim": int(attn.head_dim),
        "capacity": capacity,
        "cache_bytes_per_token": float(per_token),
        "bytes_vs_f32": float(per_token / f32_bytes),
        "ppl": float(math.exp(nll.mean())),
        "ppl_seconds": ppl_s,
        "num_tokens": n,
        "decode_steps_timed": new - 1,
        "decode_s": seconds,
        "decode_tokens_per_s": (new - 1) / seconds if seconds > 0 else float("nan"),
        "greedy_tokens": np.asarray(tokens[0]).tolist(),
        "passkey_correct": found,
        "passkey_accuracy": float(np.mean(found)),
        "point_cpu_s": time.process_time() - cpu_start,
    }

  def _speed(self, d: Mapping[str, Any]) -> dict[str, Any]:
    """The speed point (module doc): every cache of `speed.caches` filled with the same
    prompts, then decoded in interleaved rounds."""
    model, tokenizer = self.model(d)
    sp, chunk = d["speed"], d["text"]["chunk"]
    batch, prompt, steps, repeats = sp["batch"], sp["prompt"], sp["steps"], sp["repeats"]
    ids = text_lib.held_out_tokens(tokenizer, batch * prompt).reshape(batch, prompt)
    capacity = prompt + (repeats + 1) * steps + 1
    graphdef, state = nnx.split(model)
    step = streaming.step_fn(graphdef)
    runs, info = {}, {}
    for entry in sp["caches"]:
      spec, dtype = speed_spec(entry)
      dtype = jnp.dtype(dtype or d["model"]["dtype"])
      caches = model.init_caches(batch, capacity, dtype, cache=spec)
      per_token = sum(memory.measured_bytes_per_token(c) for c in caches)
      start = time.perf_counter()
      for s in range(0, prompt, chunk):  # chunked prefill, the last chunk padded
        n = min(chunk, prompt - s)
        toks = np.zeros((batch, chunk), np.int32)
        toks[:, :n] = ids[:, s:s + n]
        _, argmax, caches = step(state, caches, jnp.asarray(toks),
                                 jnp.full((batch,), n, jnp.int32), jnp.asarray(toks))
      first = argmax[:, n - 1]
      info[entry] = {"cache_bytes_per_token": float(per_token),
                     "prefill_s": time.perf_counter() - start}
      runs[entry] = (model, first, caches)
    rounds = timing.decode_rounds(runs, steps, repeats)  # generate's compiled decode loop
    wall = {e: np.asarray(rounds[e]["wall"]) for e in runs}
    f32 = next((e for e in runs if e == "dense:float32"), None)
    int8 = next((e for e in runs if e == "dense:int8"), None)
    out = {}
    for e in runs:
      t = wall[e]
      row = {**info[e], "step_ms": float(np.median(t) * 1e3),
             "step_ms_rounds": [float(x * 1e3) for x in t],
             "decode_tokens_per_s": float(batch / np.median(t)),
             "tokens": np.asarray(rounds[e]["tokens"]).tolist()}
      for name, ref in (("int8", int8), ("f32", f32)):
        row[f"tokens_per_s_vs_{name}"] = (None if ref is None
                                          else float(np.median(wall[ref] / t)))
      if f32 is not None:
        row["greedy_agreement_vs_f32"] = float(np.mean(
            np.asarray(rounds[e]["tokens"]) == np.asarray(rounds[f32]["tokens"])))
      out[e] = row
    return {"speed": out, "batch": batch, "prompt": prompt, "steps": steps, "repeats": repeats,
            "chunk": chunk, "load_avg_1min": os.getloadavg()[0]}

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    peers = self.run_peers(records[0]["config"]) if self._peers["run"] and records else None
    return write_report(self.workdir, records, title=self._title, peers=peers)

  def run_peers(self, d: Mapping[str, Any]) -> dict[str, Any]:
    """The peer step (module doc): `{"info": ..., "results": [...]}`, from
    `<workdir>/peers.json` when it holds this request's results, else measured now."""
    from kvattn.checkpoints import hub  # pylint: disable=g-import-not-at-top
    p, text = self._peers, d["text"]
    _, tokenizer = self.model(d)
    ids = text_lib.held_out_tokens(tokenizer, text["num_tokens"] + 1)
    caches = [{"name": "hf-dynamic-float32", "nbits": None}] + [
        {"name": f"hf-quanto{b}-g{p['q_group_size']}-r{p['residual']}", "nbits": int(b),
         "residual": int(p["residual"]), "q_group_size": int(p["q_group_size"])}
        for b in p["bits"]]
    request = {"gguf": str(hub.resolve(d["model"]["name"])), "ids": ids.tolist(),
               "chunk": int(text["chunk"]), "new_tokens": int(text["new_tokens"]),
               "threads": int(p["threads"]), "caches": caches}
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(self.workdir, "peers.json")
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        saved = json.load(f)
      if saved.get("key") == key:
        return saved
    out = run_peer(p["python"], request)
    out.update(key=key, command_python=p["python"])
    results.atomic_write_text(path, json.dumps(out, indent=1) + "\n")
    return out


runner.register_family("lowbit", LowbitFamily)

PEER_MODULE = "experiments.benchmarks.peers.hf_quantized_cache"


def run_peer(python: str, request: Mapping[str, Any]) -> dict[str, Any]:
  """Runs the HF QuantizedCache peer (`PEER_MODULE`) under `python` on `request` (its module
  doc) and returns `{"info": the ready line, "results": [...], "wall_s", "load_avg_1min"}`.

  Raises:
    RuntimeError: the peer failed (its last stderr lines in the message).
  """
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(request, f)
  start = time.perf_counter()
  try:
    proc = subprocess.run([python, "-m", PEER_MODULE, "--request", f.name], cwd=root,
                          input="run\nquit\n", capture_output=True, text=True, check=False)
  finally:
    os.unlink(f.name)
  lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  if proc.returncode or len(lines) != 2 or "results" not in lines[1]:
    err = " | ".join(proc.stderr.strip().splitlines()[-3:])
    raise RuntimeError(f"peer {PEER_MODULE} failed (exit {proc.returncode}): {err or 'no output'}")
  return {"info": lines[0], "results": lines[1]["results"],
          "wall_s": time.perf_counter() - start, "load_avg_1min": os.getloadavg()[0]}


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
  """One row per record: bytes (and vs f32), ppl (and vs f32), agreement, passkey, speed."""
  ref = next((r for r in records if r.get("reference")), None)
  rows = []
  for r in records:
    agree = ("-" if ref is None else
             f"{np.mean(np.asarray(r['greedy_tokens']) == np.asarray(ref['greedy_tokens'])):.3f}")
    ppl_vs = "-" if ref is None else f"{(r['ppl'] / ref['ppl'] - 1) * 100:+.2f}%"
    rows.append([r["label"], f"{r['cache_bytes_per_token']:,.1f}", f"{r['bytes_vs_f32']:.3f}x",
                 f"{r['ppl']:.4f}", ppl_vs, agree, f"{r['passkey_accuracy']:.2f}",
                 f"{r['decode_tokens_per_s']:.1f}"])
  return rows


def peer_rows(records: Sequence[Mapping[str, Any]], peers: Mapping[str, Any]) -> list[list[Any]]:
  """Table rows of the peer step's caches, against our f32 point (bytes, ppl, agreement)."""
  ref = next((r for r in records if r.get("reference")), None)
  rows = []
  for p in peers["results"]:
    ref_bytes = None if ref is None else ref["cache_bytes_per_token"]
    vs = "-" if ref_bytes is None else f"{p['cache_bytes_per_token'] / ref_bytes:.3f}x"
    ppl_vs = "-" if ref is None else f"{(p['ppl'] / ref['ppl'] - 1) * 100:+.2f}%"
    agree = "-" if ref is None else f"{np.mean(np.asarray(p['greedy_tokens']) == np.asarray(ref['greedy_tokens'])):.3f}"
    rows.append([p["name"], f"{p['cache_bytes_per_token']:,.1f}", vs, f"{p['ppl']:.4f}", ppl_vs,
                 agree, "-", f"{p['decode_tokens_per_s']:.1f}"])
  return rows


def speed_table(record: Mapping[str, Any]) -> list[str]:
  """The speed point's section of report.md (module doc)."""
  headers = ["cache", "cache B/token", "decode step ms", "decode tok/s", "tok/s vs int8",
             "tok/s vs f32", "greedy agreement vs f32"]
  fmt = lambda x, f: "-" if x is None else format(x, f)
  rows = [[name, f"{r['cache_bytes_per_token']:,.1f}", f"{r['step_ms']:.1f}",
           f"{r['decode_tokens_per_s']:.2f}", fmt(r["tokens_per_s_vs_int8"], ".3f") + "x",
           fmt(r["tokens_per_s_vs_f32"], ".3f") + "x", fmt(r.get("greedy_agreement_vs_f32"),
                                                           ".3f")]
          for name, r in record["speed"].items()]
  return [f"## Decode speed at batch {record['batch']}, prompt {record['prompt']}", "",
          f"Each cache filled with the same {record['batch']} rows of {record['prompt']} held-out "
          f"tokens ({record['chunk']} per forward pass), then {record['repeats']} interleaved "
          f"rounds of {record['steps']} greedy decode steps (generate's compiled loop; median "
          f"step, medians of per-round ratios; 1-minute load {record['load_avg_1min']:.1f}).", "",
          report_lib.markdown_table(headers, rows), ""]


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str,
                 peers: Mapping[str, Any] | None = None) -> str:
  """report.md (one table against the f32 dense point, the peer step's rows last, then the
  speed point's table); returns the markdown."""
  speed = [r for r in records if r.get("kind") == "speed"]
  records = [r for r in records if r.get("kind") != "speed"]
  headers = ["point", "cache B/token", "vs f32", "ppl", "ppl vs f32", "greedy agreement",
             "passkey", "decode tok/s"]
  md = [f"# {title}", ""]
  if records:
    r0 = records[0]
    cfg = r0["config"]
    md += [f"Model `{cfg['model']['name']}` ({r0['num_layers']} layers, {r0['num_kv_heads']} KV "
           f"heads of {r0['head_dim']}; compute {cfg['model']['dtype']}), batch 1, caches of "
           f"{r0['capacity']} tokens (bytes per token of every layer, everything stored). "
           f"Perplexity: {r0['num_tokens']} held-out tokens streamed {cfg['text']['chunk']} per "
           f"forward pass; then {cfg['text']['new_tokens']} greedy tokens from that cache "
           f"(agreement with the f32 dense cache; decode tok/s over the "
           f"{r0['decode_steps_timed']} steps after the first); passkey at "
           f"{cfg['passkey']['context']} tokens, {cfg['passkey']['samples']} prompts.", ""]
  rows = table_rows(records) + ([] if not peers else peer_rows(records, peers))
  if rows:  # (a run of the speed point alone has none)
    md += [report_lib.markdown_table(headers, rows), ""]
  if peers:
    info = peers["info"]
    md += [f"Rows `hf-*`: transformers {info.get('version')} (torch {info.get('torch')}, "
           f"optimum-quanto {info.get('optimum_quanto')}, {info.get('threads')} threads) in its "
           f"own process after the points (not interleaved), on the same tokens; bytes per token "
           f"read from its tensors after the text; its own f32 DynamicCache is the first row.", ""]
  for record in speed:
    md += speed_table(record)
  text = "\n".join(md)
  results.atomic_write_text(os.path.join(workdir, "report.md"), text)
  return text
