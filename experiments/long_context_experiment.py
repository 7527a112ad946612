r"""Long-context caches on a real model: streaming perplexity, passkey retrieval and cost.

    python -m experiments.long_context_experiment --config=configs/long_context.py:smoke \
        --workdir=/tmp/long_context

The "long_context" family of experiments/runner.py (`experiment.kind =
"long_context"`). One point per sweep entry of configs/long_context.py: a
cache policy (`kvattn.cache_factories.policy_caches`: "full", "window" = a
ring without sinks, "sink" = StreamingLLM, or an eviction policy of
`kvattn.long_context`) at a budget, on the model `model.name`
(`kvattn.from_pretrained`). Measured per point:

  * streaming perplexity: `text.num_tokens + 1` tokens of the default corpus
    of `kvattn.data` (stdlib sources and pydoc topics, tokenized with the
    model's tokenizer) go through the cache `text.chunk` tokens per forward
    pass; each token's negative log-likelihood is read from the logits of the
    token before it. Reported: perplexity overall, over the second half, and
    per position bin (the plot);
  * passkey retrieval: for each context length of `passkey.contexts`, one
    batch of prompts (one row per depth of `passkey.depths`: filler sentences,
    the needle "The pass key is NNNNN. Remember it. NNNNN is the pass key." at
    that depth, then "What is the pass key? The pass key is"), prefilled in
    chunks, then `passkey.new_tokens` greedy tokens; a row is correct when the
    5 digits appear in them;
  * cache bytes per sequence (the storage arrays, checked equal to capacity x
    the model's bytes per token) and the bookkeeping bytes (slot positions,
    eviction scores, lengths) beside them;
  * decode: `decode.steps` timed single-token steps (batch 1) after the
    perplexity run, when the cache is at its budget: tokens/s, and the
    eviction overhead per step (this point's step time minus the ring's at the
    same budget, in the report).

The report (report.md) puts the numbers next to the published claims
(StreamingLLM, H2O, SnapKV, kvpress) and says which hold on this model;
ppl_vs_position.png and passkey_<policy>.png are its plots.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from experiments import cli
from experiments import report as report_lib
from experiments import results
from experiments import runner
from kvattn import cache_factories
from kvattn import data as data_lib
from kvattn import long_context
from kvattn import transformer as transformer_lib

KINDS = ("full", "window", "sink") + long_context.POLICIES
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is"
FILES = {"plot": "ppl_vs_position.png", "heatmap": "passkey_{kind}.png"}

# The published claims the report checks (paper, what it reports).
CLAIMS = {
    "streamingllm": "Xiao et al. 2023 (arXiv 2309.17453), Fig. 3 / Table 1: a window without "
                    "sinks explodes in perplexity once the first tokens leave it; 4 sinks keep "
                    "perplexity near the full cache's.",
    "h2o": "Zhang et al. 2023 (arXiv 2306.14048): a 20% heavy-hitter + recent budget performs "
           "close to the full cache.",
    "snapkv": "Li et al. 2024 (arXiv 2404.14469): a compressed cache keeps needle retrieval "
              "close to the full cache.",
    "kvpress": "NVIDIA kvpress benchmarks: every method degrades, even at small compression "
               "ratios.",
}


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "long_context" config (configs/long_context.py documents each)."""
  return {
      "model": ("name", "dtype"),
      "policy": ("kind", "budget", "num_sinks"),
      "text": ("num_tokens", "chunk", "bins"),
      "passkey": ("contexts", "depths", "new_tokens", "seed"),
      "decode": ("steps",),
      "experiment": ("kind", "name", "max_points"),
  }


def policy_dict(policy: Mapping[str, Any]) -> dict[str, Any]:
  """The `kvattn.cache_factories.policy_caches` dict of a config's `policy` section."""
  kind, budget = policy["kind"], policy["budget"]
  if kind == "full":
    return {"kind": "full"}
  if kind == "window":
    return {"kind": "window", "window": budget}
  if kind == "sink":
    return {"kind": "sink", "num_sinks": policy["num_sinks"],
            "window": budget - policy["num_sinks"]}
  return {"kind": kind, "budget": budget}


def _tiny_model():
  """A 2-layer random GQA model (byte vocabulary) for tests: `model.name = "random-tiny"`."""
  cfg = transformer_lib.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                     attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


class _ByteTokenizer:
  """`kvattn.data`'s byte tokenizer with the encode/decode of `kvattn.Tokenizer`."""

  def encode(self, text: str) -> list[int]:
    return [int(i) for i in data_lib.encode(text)]

  def decode(self, ids) -> str:
    return data_lib.decode(np.asarray(ids))


def load_model(name: str, dtype: str):
  """`(model, tokenizer)`: `kvattn.from_pretrained(name)`, or the random tiny model."""
  if name == "random-tiny":
    return _tiny_model(), _ByteTokenizer()
  import kvattn  # pylint: disable=g-import-not-at-top
  return kvattn.from_pretrained(name, dtype=jnp.dtype(dtype))


def corpus_tokens(tokenizer, count: int) -> np.ndarray:
  """The first `count` tokens of the default corpus of `kvattn.data` (documents joined)."""
  ids: list[int] = []
  budget = 4096
  while len(ids) < count:
    budget *= 4
    docs = data_lib.load_corpus(max_bytes=budget)
    text = "\n\n".join(d.data.decode("utf-8") for d in docs)
    ids = tokenizer.encode(text)
  return np.asarray(ids[:count], np.int32)


def passkey_prompt(tokenizer, context: int, depth: float, key: int) -> list[int]:
  """Token ids of a passkey prompt of about `context` tokens, the needle at `depth`."""
  needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
  fixed = len(tokenizer.encode(needle + QUESTION))
  per = len(tokenizer.encode(FILLER * 8)) / 8
  reps = max(1, int((context - fixed) / per))
  before = int(round(depth * reps))
  return tokenizer.encode(FILLER * before + needle + FILLER * (reps - before) + QUESTION)


@functools.lru_cache(maxsize=8)
def _step_fn(graphdef):
  """Jitted `(state, caches, tokens, new_lengths, targets) -> (nll, argmax, caches)`."""

  @jax.jit
  def step(state, caches, tokens, new_lengths, targets):
    logits, caches = nnx.merge(graphdef, state)(tokens, caches, new_lengths=new_lengths)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32), caches

  return step


def _ready(x):
  jax.block_until_ready(x)
  return x


def streaming_nll(model, caches, ids: np.ndarray, chunk: int) -> tuple[np.ndarray, Any]:
  """Streams `ids` through `caches`, `chunk` tokens per forward pass (StreamingLLM's evaluation).

  Args:
    model: the model (`kvattn.Transformer`).
    caches: empty per-layer caches of batch 1 (any kind of the cache protocol).
    ids: `i32[n + 1]` token ids; token i + 1 is predicted from tokens 0..i.
    chunk: tokens fed per forward pass (1 = exact token-by-token streaming).

  Returns:
    `(nll f64[n], caches)`: each token's negative log-likelihood (nats) and the caches after.
  """
  graphdef, state = nnx.split(model)
  step = _step_fn(graphdef)
  num_tokens = len(ids) - 1
  nll = np.zeros(num_tokens, np.float64)
  for s in range(0, num_tokens, chunk):
    e = min(num_tokens, s + chunk)
    toks = np.zeros((1, chunk), np.int32)
    tgts = np.zeros((1, chunk), np.int32)
    toks[0, :e - s], tgts[0, :e - s] = ids[s:e], ids[s + 1:e + 1]
    out, _, caches = step(state, caches, jnp.asarray(toks), jnp.array([e - s], jnp.int32),
                          jnp.asarray(tgts))
    nll[s:e] = np.asarray(out[0, :e - s])
  return nll, caches


def passkey_correct(model, make_caches, prompts: Sequence[Sequence[int]], keys: Sequence[int],
                    chunk: int, new_tokens: int, tokenizer) -> list[int]:
  """Chunked prefill of the prompts (one row each), greedy decode; 1 where the key appears.

  Args:
    model: the model (`kvattn.Transformer`).
    make_caches: `(batch, capacity) -> caches`: empty per-layer caches of any kind.
    prompts: token ids of each row's prompt (`passkey_prompt`).
    keys: the pass key hidden in each prompt.
    chunk: prompt tokens per forward pass.
    new_tokens: greedy tokens decoded after the prompt.
    tokenizer: decodes the generated ids (`decode(ids) -> str`).

  Returns:
    Per row, 1 if the key's digits appear in the decoded tokens, else 0.
  """
  graphdef, state = nnx.split(model)
  step = _step_fn(graphdef)
  batch, width = len(prompts), max(len(p) for p in prompts)
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded = -(-width // chunk) * chunk
  toks = np.zeros((batch, padded), np.int32)
  for b, p in enumerate(prompts):
    toks[b, :len(p)] = p
  caches = make_caches(batch, padded + new_tokens)
  last = np.zeros(batch, np.int32)
  for s in range(0, padded, chunk):
    new = np.clip(lengths - s, 0, chunk).astype(np.int32)
    blk = jnp.asarray(toks[:, s:s + chunk])
    _, arg, caches = step(state, caches, blk, jnp.asarray(new), blk)
    arg = np.asarray(arg)
    for b in range(batch):
      if 0 < lengths[b] - s <= chunk:
        last[b] = arg[b, lengths[b] - s - 1]
  out = [last.copy()]
  nxt = jnp.asarray(last[:, None])
  ones = jnp.ones((batch,), jnp.int32)
  for _ in range(new_tokens - 1):
    _, nxt, caches = step(state, caches, nxt, ones, nxt)
    out.append(np.asarray(nxt[:, 0]))
  generated = np.stack(out, axis=1)
  return [int(str(key) in tokenizer.decode(generated[b].tolist()))
          for b, key in enumerate(keys)]


class LongContextFamily:
  """Cache policies x budgets on one real model (module doc)."""

  kind = "long_context"

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.schema = schema()
    self._title = "kvattn: long-context caches"
    self._config: dict[str, Any] | None = None
    self._model: tuple[str, Any, Any] | None = None

  def _check(self, d: Mapping[str, Any], where: str) -> None:
    policy, text, passkey = d["policy"], d["text"], d["passkey"]
    if policy["kind"] not in KINDS:
      raise ValueError(f"{where}: policy.kind must be one of {KINDS}; got {policy['kind']!r}")
    budget = runner.check_int(f"{where}: policy.budget", policy["budget"], 2)
    sinks = runner.check_int(f"{where}: policy.num_sinks", policy["num_sinks"], 0)
    if policy["kind"] == "sink" and budget < sinks + 1:
      raise ValueError(f"{where}: policy.budget must be >= policy.num_sinks + 1 = {sinks + 1}; "
                       f"got {budget}")
    runner.check_int(f"{where}: text.num_tokens", text["num_tokens"], 2)
    runner.check_int(f"{where}: text.chunk", text["chunk"])
    runner.check_int(f"{where}: text.bins", text["bins"])
    for c in passkey["contexts"]:
      runner.check_int(f"{where}: passkey.contexts", c, 32)
    for depth in passkey["depths"]:
      if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise ValueError(f"{where}: passkey.depths must be numbers in [0, 1]; got {depth!r}")
    runner.check_int(f"{where}: passkey.new_tokens", passkey["new_tokens"])
    runner.check_int(f"{where}: decode.steps", d["decode"]["steps"])
    # Builds (and so validates) the policy's caches for a 1-layer stand-in.
    cache_factories._policy_dict(policy_dict(policy))  # pylint: disable=protected-access

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """One point per sweep entry; all validated before any work (ValueError naming the key)."""
    base = runner.to_dict(config)
    runner.check_schema(base, self.schema)
    self._check(base, "config")
    self._config = base
    self._title = base["experiment"]["name"] or self._title
    points, seen = [], {}
    for i, overrides in enumerate(sweep or [{}]):
      where = f"sweep[{i}] {dict(overrides)}" if overrides else "config"
      d = runner.apply_overrides(config, overrides, where)
      self._check(d, where)
      policy = d["policy"]
      label = "full" if policy["kind"] == "full" else f"{policy['kind']}-{policy['budget']}"
      measured = {s: d[s] for s in ("model", "text", "passkey", "decode")}
      measured["policy"] = policy_dict(policy)
      pid = f"{label}-{runner.digest(measured)}"
      if pid in seen:
        raise ValueError(f"{where}: gives the same point {label} as {seen[pid]}")
      seen[pid] = where
      points.append(runner.Point(pid, label, copy.deepcopy(d), d["model"]["name"], {
          "kind": policy["kind"],
          "budget": None if policy["kind"] == "full" else policy["budget"]}))
    return points

  def model(self, point: runner.Point):
    if self._model is None or self._model[0] != point.group:
      m, tok = load_model(point.config["model"]["name"], point.config["model"]["dtype"])
      self._model = (point.group, m, tok)
    return self._model[1], self._model[2]

  # -- measurement ----------------------------------------------------------------------------

  def measure(self, point: runner.Point) -> dict[str, Any]:
    d = point.config
    model, tokenizer = self.model(point)
    graphdef, state = nnx.split(model)
    step = _step_fn(graphdef)
    policy = policy_dict(d["policy"])
    text, passkey, dec = d["text"], d["passkey"], d["decode"]
    dtype = jnp.dtype(d["model"]["dtype"])
    chunk = text["chunk"]

    # Streaming perplexity.
    ids = corpus_tokens(tokenizer, text["num_tokens"] + 1)
    total = text["num_tokens"] + dec["steps"] + 1
    caches = model.init_caches(1, total, dtype, policy=policy)
    start_time = time.perf_counter()
    nll, caches = streaming_nll(model, caches, ids, chunk)
    ppl_s = time.perf_counter() - start_time
    bins = np.array_split(nll, text["bins"])
    storage = sum(a.nbytes for c in caches for a in c.storage_arrays())
    every = sum(x.nbytes for x in jax.tree_util.tree_leaves(caches))
    capacity = caches[0].capacity
    per_token = transformer_lib.cache_bytes_per_token(model.spec, dtype)
    if storage != capacity * per_token:
      raise runner.CacheAccountingError(
          f"{point.label}: cache storage {storage} B != capacity {capacity} x {per_token} B/token")

    # Decode speed with the cache at its budget (the first step compiles, untimed).
    tok = jnp.asarray(ids[-1:].reshape(1, 1))
    one = jnp.ones((1,), jnp.int32)
    _, nxt, caches = _ready(step(state, caches, tok, one, tok))
    t0 = time.perf_counter()
    for _ in range(dec["steps"]):
      _, nxt, caches = step(state, caches, nxt, one, nxt)
    _ready(nxt)
    step_s = (time.perf_counter() - t0) / dec["steps"]

    # Passkey retrieval.
    rng = np.random.default_rng(passkey["seed"])
    correct: dict[str, list[int]] = {}
    for context in passkey["contexts"]:
      keys = rng.integers(10000, 100000, len(passkey["depths"])).tolist()
      prompts = [passkey_prompt(tokenizer, context, depth, key)
                 for depth, key in zip(passkey["depths"], keys)]
      correct[str(context)] = passkey_correct(
          model, lambda b, n: model.init_caches(b, n, dtype, policy=policy), prompts, keys,
          chunk, passkey["new_tokens"], tokenizer)
    return {
        "ppl": float(math.exp(nll.mean())),
        "ppl_second_half": float(math.exp(nll[len(nll) // 2:].mean())),
        "ppl_bins": [float(math.exp(b.mean())) for b in bins],
        "ppl_seconds": ppl_s,
        "chunk": chunk,
        "num_tokens": text["num_tokens"],
        "capacity": capacity,
        "cache_bytes_per_seq": storage,
        "bookkeeping_bytes_per_seq": every - storage,
        "decode_step_ms": step_s * 1e3,
        "decode_tokens_per_s": 1.0 / step_s,
        "passkey_correct": correct,
        "passkey_depths": [float(x) for x in passkey["depths"]],
        "passkey_accuracy": float(np.mean([v for row in correct.values() for v in row])),
    }

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    return write_report(self.workdir, records, title=self._title, config=self._config)


runner.register_family("long_context", LongContextFamily)


# ----------------------------------------------------------------------------------------------
# Report.


def _fmt(x, digits=2):
  return "-" if x is None else f"{x:.{digits}f}"


def claims(records: Sequence[Mapping[str, Any]]) -> list[str]:
  """One line per published claim: the measured numbers and whether the claim holds."""
  by = {(r["kind"], r["budget"]): r for r in records}
  full = by.get(("full", None))
  if full is None:
    return ["(no full-cache point: the claims need it)"]
  base = full["ppl"]
  budgets = sorted({b for (_, b) in by if b is not None})
  lines = []
  paired = [b for b in budgets if ("window", b) in by and ("sink", b) in by]
  window = [(b, by[("window", b)]["ppl"] / base) for b in paired]
  sink = [(b, by[("sink", b)]["ppl"] / base) for b in paired]
  if window and sink:
    explodes = all(w > 2 for _, w in window)
    near = all(s < 1.25 for _, s in sink)
    lines.append(
        f"- **StreamingLLM** ({CLAIMS['streamingllm']}) Measured perplexity / full-cache "
        f"perplexity: window without sinks "
        f"{', '.join(f'{r:.2f}x@{b}' for b, r in window)}; 4 sinks "
        f"{', '.join(f'{r:.2f}x@{b}' for b, r in sink)}. Explodes (> 2x) without sinks: "
        f"{'holds' if explodes else 'does not hold'}; near the full cache (< 1.25x) with sinks: "
        f"{'holds' if near else 'does not hold'}.")
  num_tokens = full["num_tokens"]
  h2o = [(b, by[("h2o", b)]) for b in budgets if ("h2o", b) in by]
  if h2o:
    b, r = min(h2o, key=lambda x: abs(x[0] / num_tokens - 0.2))
    ratio = r["ppl"] / base
    lines.append(
        f"- **H2O** ({CLAIMS['h2o']}) Budget {b} = {100 * b / num_tokens:.0f}% of the "
        f"{num_tokens}-token text: perplexity {ratio:.2f}x the full cache; passkey accuracy "
        f"{r['passkey_accuracy']:.2f} vs {full['passkey_accuracy']:.2f}. Close (< 1.1x): "
        f"{'holds' if ratio < 1.1 else 'does not hold'}.")
  snap = [(b, by[("snapkv", b)]) for b in budgets if ("snapkv", b) in by]
  if snap:
    accs = ", ".join(f"{r['passkey_accuracy']:.2f}@{b}" for b, r in snap)
    holds = all(r["passkey_accuracy"] >= full["passkey_accuracy"] - 0.1 for _, r in snap)
    lines.append(
        f"- **SnapKV** ({CLAIMS['snapkv']}) Passkey accuracy {accs} vs full "
        f"{full['passkey_accuracy']:.2f}: within 0.1 of the full cache: "
        f"{'holds' if holds else 'does not hold'}.")
  bounded = [r for (k, b), r in by.items() if b is not None]
  if bounded:
    worse = sum(r["ppl"] > base * 1.001 for r in bounded)
    lines.append(
        f"- **kvpress** ({CLAIMS['kvpress']}) {worse} of {len(bounded)} bounded points have a "
        f"higher perplexity than the full cache (> 0.1%): "
        f"{'holds' if worse == len(bounded) else 'does not hold for every point'}.")
  return lines


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str,
                 config: Mapping[str, Any] | None) -> str:
  """report.md, ppl_vs_position.png and one passkey heat map per kind; returns the markdown."""
  records = sorted(records, key=lambda r: (r["budget"] or 0, r["kind"]))
  by = {(r["kind"], r["budget"]): r for r in records}
  full = by.get(("full", None))
  ring = {b: r for (k, b), r in by.items() if k == "window"}
  rows = []
  for r in records:
    kind, budget = r["kind"], r["budget"]
    overhead = (r["decode_step_ms"] - ring[budget]["decode_step_ms"]) if budget in ring else None
    ctx = " / ".join(f"{np.mean(v):.2f}" for v in r["passkey_correct"].values())
    rows.append([kind, budget or "all", _fmt(r["ppl"], 3),
                 _fmt(r["ppl"] / full["ppl"]) if full else "-", _fmt(r["ppl_second_half"], 3),
                 ctx, f"{r['cache_bytes_per_seq'] / 2**20:.2f}",
                 f"{r['bookkeeping_bytes_per_seq'] / 2**10:.1f}",
                 _fmt(r["decode_tokens_per_s"], 1), _fmt(overhead)])
  contexts = " / ".join(next(iter(records))["passkey_correct"]) if records else ""
  chunk = records[0]["chunk"] if records else None
  num_tokens = records[0]["num_tokens"] if records else None
  table = report_lib.markdown_table(
      ["policy", "budget", "ppl", "ppl / full", "ppl 2nd half", f"passkey acc ({contexts})",
       "cache MiB/seq", "bookkeeping KiB/seq", "decode tok/s", "eviction ms/step"], rows)
  md = [f"# {title}", "",
        f"Streaming perplexity over {num_tokens} tokens of the default corpus of kvattn.data, "
        f"fed {chunk} tokens per forward pass (chunk length {chunk}; 1 would be exact "
        f"token-by-token streaming). Passkey accuracy per context length (tokens), averaged "
        f"over depths. Cache MiB/seq: the storage arrays (checked equal to capacity x bytes per "
        f"token); bookkeeping: slot positions, eviction scores, lengths. Eviction ms/step: "
        f"the decode step time minus the ring's at the same budget.", "", table, "",
        "## Published claims", "", *claims(records), "",
        f"![perplexity vs position]({FILES['plot']})", ""]
  md += [f"![passkey {k}]({FILES['heatmap'].format(kind=k)})"
         for k in sorted({r["kind"] for r in records})]
  text = "\n".join(md) + "\n"
  results.atomic_write_text(os.path.join(workdir, "report.md"), text)
  if records:
    _plots(workdir, records)
  return text


def _plots(workdir: str, records: Sequence[Mapping[str, Any]]) -> None:
  plt = report_lib.pyplot()
  budgets = sorted({r["budget"] for r in records if r["budget"]}) or [None]
  fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
  for ax, budget in zip(axes[0], budgets):
    for r in records:
      if r["budget"] in (budget, None):
        bins = r["ppl_bins"]
        centers = (np.arange(len(bins)) + 0.5) * r["num_tokens"] / len(bins)
        ax.plot(centers, bins, marker=".", label=r["kind"])
    ax.set_yscale("log")
    ax.set_title(f"budget {budget}")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("perplexity")
    ax.legend(fontsize=7)
  report_lib.save_figure(fig, os.path.join(workdir, FILES["plot"]))
  for kind in sorted({r["kind"] for r in records}):
    mine = [r for r in records if r["kind"] == kind]
    fig, axes = plt.subplots(1, len(mine), figsize=(4 * len(mine), 3), squeeze=False)
    for ax, r in zip(axes[0], mine):
      contexts = list(r["passkey_correct"])
      grid = np.array([r["passkey_correct"][c] for c in contexts], float)
      ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
      ax.set_yticks(range(len(contexts)), contexts)
      ax.set_xticks(range(grid.shape[1]), [f"{x:g}" for x in r["passkey_depths"]])
      ax.set_xlabel("needle depth")
      ax.set_ylabel("context (tokens)")
      ax.set_title(f"{kind} budget {r['budget'] or 'all'}")
    report_lib.save_figure(fig, os.path.join(workdir, FILES["heatmap"].format(kind=kind)))


# ----------------------------------------------------------------------------------------------
# Entry point.

FLAGS = flags.FLAGS


def _define_flags():
  config_flags.DEFINE_config_file(
      "config", None, "configs/long_context.py or configs/long_context.py:smoke.",
      lock_config=True)
  flags.DEFINE_string("workdir", None, "Directory for results.jsonl, report.md and plots.")
  flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  """Runs configs/long_context.py as `experiments.main` would."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  runner.main(FLAGS.config, FLAGS.workdir, config_flags.get_config_filename(FLAGS["config"]))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
