"""Speculative decoding on a real model: accepted tokens per pass and decode speed-up.

    python -m experiments.benchmarks.speculative --model smollm2-135m-instruct --new_tokens 128 \\
        --num_draft_tokens 4 --rounds 5 [--draft_layers 8] [--peers --peer_python PY]
    python -m experiments.benchmarks.speculative --memory
    python -m experiments.benchmarks.speculative --verify_cost [--steps 16 --rounds 5]
    python -m experiments.benchmarks.speculative --batcher --prompts continue:specialnames,...

Text: Python's own documentation (`pydoc_data.topics`), where n-grams repeat. Each prompt
(`--prompts`) is one topic: `continue` feeds the topic's first `--prompt_tokens` tokens raw
(the model continues the documentation); `chat` asks the instruct model, through its chat
template, to explain the topic's first `--prompt_tokens` tokens. Batch 1, greedy.

Per round, interleaved, each on a copy of the same prefilled caches: kvattn's plain
compiled decode loop (`generate`'s), speculative decoding with prompt lookup
(`PromptLookup(num_draft_tokens, max_ngram_size)`) and, with `--draft_layers N`, with
the model's first N layers as a draft model (`DraftModel`, not retrained). Reported:
median decode seconds, speed-up over plain (ratio of medians measured in the same run),
tokens per verify pass (`1 + accepted / passes`) and whether the tokens equal plain
greedy's. With `--peers`, HF transformers (`--peer_python`, the same GGUF in f32) times
`generate(do_sample=False)` plain and with `prompt_lookup_num_tokens` in a subprocess,
alone (ours idle), between our rounds (each round alternates who goes first); its decode
seconds are `generate(new_tokens)`'s minus `generate(1)`'s (prefill, first token and
generate's fixed costs), timed back to back in the peer. Prints one JSON line per prompt and system.

`--verify_cost` times what one verify pass costs against one plain decode step inside a
compiled loop (`lax.fori_loop` of `--steps` iterations, caches donated, one copy of the same
prefilled caches per variant and round, rounds interleaved): `step` (T = 1, as `generate`'s
loop), `verify_T` (T tokens through a transaction, keep 1: what a pass that accepts nothing
costs), `chunk_T` (the same T-token forward without the transaction), and the model's own
MLP matmuls alone at M = 1 and M = T rows (`mlp_T`), which isolate XLA's dot for few rows.
Prints one JSON line per variant: wall and process-CPU seconds per iteration (medians) and
their ratio to `step` (or to `mlp_1`).

`--batcher` serves every `--prompts` prompt together through `ContinuousBatcher` (one slot
each, paged pools of 16-token pages), without and with `speculative=PromptLookup(...)` (and
with `--draft_layers N`, `DraftModel` of the first N layers),
rounds interleaved (one untimed warm-up each): wall seconds of the whole `run` (prefills
included), steps, tokens per slot pass, and whether every request's tokens are equal.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from experiments.framework import cli
from experiments.framework import timing
from kvattn.checkpoints import hub
from kvattn.checkpoints import pretrained
from kvattn.inference import speculative

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "Registered name (kvattn.checkpoints.hub) or file.")
flags.DEFINE_list("prompts", ["continue:specialnames", "continue:typesseq", "chat:string-methods"],
                  "mode:topic of pydoc_data.topics (mode continue or chat).")
flags.DEFINE_integer("prompt_tokens", 384, "Tokens of the topic's text in the prompt.")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated (the first comes from prefill).")
flags.DEFINE_integer("num_draft_tokens", 4, "k: drafted tokens per verify pass.")
flags.DEFINE_integer("max_ngram_size", 3, "Prompt lookup: longest n-gram matched.")
flags.DEFINE_integer("draft_layers", 0, "Also a draft model of the first N layers (0: off).")
flags.DEFINE_enum("param_dtype", "float32", ["float32", "int8"],
                  "Weights: f32, or int8 (W8A8, kvattn.models.int8) -- the HF peer stays f32.")
flags.DEFINE_enum("cache_dtype", "float32", ["float32", "bfloat16", "int8", "float8_e4m3fn"],
                  "Dtype of the dense caches (plain and speculative alike).")
flags.DEFINE_integer("rounds", 5, "Interleaved timed rounds (after one untimed warm-up).")
flags.DEFINE_bool("peers", False, "Also time HF transformers (subprocess of --peer_python).")
flags.DEFINE_string("peer_python", "/work/peers-venv/bin/python", "Python of the HF peer.")
flags.DEFINE_bool("verify_cost", False, "Only time one verify pass against one plain step "
                  "inside compiled loops, and the MLP matmuls at 1 and T rows (module doc).")
flags.DEFINE_bool("batcher", False, "Only time ContinuousBatcher with and without prompt "
                  "lookup over all --prompts at once (module doc).")
flags.DEFINE_integer("steps", 16, "--verify_cost: loop iterations per timed call.")
flags.DEFINE_bool("memory", False, "Only compile one verify pass per cache kind (a random "
                  "4-layer model, 2048 slots) with and without a transaction and print XLA's "
                  "temp bytes: what the rollback costs in memory.")

MEMORY_KINDS = ({"kind": "dense"}, {"kind": "paged", "page_size": 16},
                {"kind": "ring", "window": 2048}, {"kind": "sink", "num_sinks": 4, "window": 2044},
                {"kind": "h2o", "budget": 2048},
                {"kind": "length_switch", "switch_length": 1024, "num_kv_heads_after": 2})


def memory() -> None:
  """Temp bytes of one verify pass (T = k + 1) alone and inside a transaction (module doc)."""
  from kvattn.caches import registry, transaction  # pylint: disable=g-import-not-at-top
  from kvattn.models import transformer  # pylint: disable=g-import-not-at-top
  cfg = transformer.model_config(d_model=256, num_layers=4, mlp_dim=768, vocab_size=259,
                                 attention=dict(num_heads=8, num_kv_heads=8, head_dim=32))
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  num_tokens = FLAGS.num_draft_tokens + 1

  def plain(state, caches, tokens):
    return nnx.merge(graphdef, state).hidden(tokens, caches)

  def in_transaction(state, caches, tokens, keep):
    h, drafts = nnx.merge(graphdef, state).hidden(tokens, transaction.begin_all(caches))
    return h, transaction.commit_all(drafts, keep)

  for spec in MEMORY_KINDS:
    caches = registry.build_caches(model, 1, 2048, None, spec)
    tokens = jnp.zeros((1, num_tokens), jnp.int32)
    a = jax.jit(plain, donate_argnums=1).lower(state, caches, tokens).compile()
    b = jax.jit(in_transaction, donate_argnums=1).lower(
        state, caches, tokens, jnp.ones((1,), jnp.int32)).compile()
    a, b = a.memory_analysis().temp_size_in_bytes, b.memory_analysis().temp_size_in_bytes
    print(json.dumps(dict(kind=spec["kind"], tokens=num_tokens, cache_bytes=sum(
        x.nbytes for c in caches for x in c.storage_arrays()), pass_temp_bytes=a,
                          transaction_temp_bytes=b, extra_bytes=b - a)))


def verify_cost() -> None:
  """Seconds per loop iteration of a plain step, a verify pass and a T-token chunk, and of
  the MLP matmuls at 1 and T rows (module doc); one JSON line each."""
  from kvattn.caches import transaction  # pylint: disable=g-import-not-at-top
  model, tokenizer = pretrained.from_pretrained(FLAGS.model, dtype=jnp.float32,
                                                param_dtype=FLAGS.param_dtype)
  graphdef, state = nnx.split(model)
  k, steps = FLAGS.num_draft_tokens, FLAGS.steps
  prompt = _prompt(tokenizer, FLAGS.prompts[0])[None]
  lengths = np.array([prompt.shape[1]], np.int32)
  caches = model.init_caches(1, prompt.shape[1] + steps + k + 1)
  _, first, caches, _ = timing.timed_prefill(model, prompt, lengths, caches)

  def loop(num_tokens: int, in_transaction: bool):
    def run(state, caches, token):
      m = nnx.merge(graphdef, state)

      def body(_, carry):
        token, caches = carry
        fed = jnp.broadcast_to(token[:, None], (1, num_tokens))
        n = jnp.full((1,), num_tokens, jnp.int32)
        if in_transaction:
          h, drafts = m.hidden(fed, transaction.begin_all(caches), new_lengths=n)
          greedy = jnp.argmax(m.logits_from_hidden(h), axis=-1).astype(jnp.int32)
          caches = transaction.commit_all(drafts, jnp.ones((1,), jnp.int32))
        else:
          h, caches = m.hidden(fed, caches, new_lengths=n)
          greedy = jnp.argmax(m.logits_from_hidden(h), axis=-1).astype(jnp.int32)
          caches = tuple(c.replace(lengths=c.lengths - (num_tokens - 1)) for c in caches)
        return greedy[:, 0], caches

      return jax.lax.fori_loop(0, steps, body, (token, caches))
    return jax.jit(run, donate_argnums=1)

  mlp = [(layer.mlp.gate[...], layer.mlp.up[...], layer.mlp.down[...]) for layer in model.layers]

  def mlp_loop(rows: int):
    def run(weights, x):
      def body(_, x):
        for gate, up, down in weights:
          x = (jax.nn.silu(x @ gate) * (x @ up)) @ down
          x = x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-6)
        return x
      return jax.lax.fori_loop(0, steps, body, x)
    return jax.jit(run), jnp.full((rows, mlp[0][0].shape[0]), 0.01, jnp.float32)

  variants = {"step": loop(1, False), f"verify_{k + 1}": loop(k + 1, True),
              f"chunk_{k + 1}": loop(k + 1, False)}
  mlps = {"mlp_1": mlp_loop(1), f"mlp_{k + 1}": mlp_loop(k + 1)}
  copy = lambda: jax.tree.map(jnp.copy, caches)
  wall = {name: [] for name in [*variants, *mlps]}
  cpu = {name: [] for name in wall}
  for r in range(FLAGS.rounds + 1):  # round 0 compiles: not timed
    for name, fn in variants.items():
      w, c, _ = timing.timed(fn, state, copy(), first)
      wall[name].append(w / steps)
      cpu[name].append(c / steps)
    for name, (fn, x) in mlps.items():
      w, c, _ = timing.timed(fn, mlp, x)
      wall[name].append(w / steps)
      cpu[name].append(c / steps)
  env = dict(device=str(jax.devices()[0]), cpus=os.cpu_count(), load_avg=os.getloadavg()[0],
             prompt=FLAGS.prompts[0], cache_slots=int(caches[0].max_len), steps=steps,
             rounds=FLAGS.rounds)
  med = {name: (statistics.median(wall[name][1:]), statistics.median(cpu[name][1:]))
         for name in wall}
  for name in wall:
    base = med["mlp_1" if name.startswith("mlp") else "step"]
    print(json.dumps(dict(env, variant=name, wall_s=med[name][0], cpu_s=med[name][1],
                          wall_ratio=med[name][0] / base[0], cpu_ratio=med[name][1] / base[1],
                          wall_all=wall[name][1:])))


def batcher() -> None:
  """The continuous batcher with and without speculation over all `--prompts` (module doc)."""
  from kvattn.inference.batching import ContinuousBatcher  # pylint: disable=g-import-not-at-top
  model, tokenizer = pretrained.from_pretrained(FLAGS.model, dtype=jnp.float32,
                                                param_dtype=FLAGS.param_dtype)
  n, k = FLAGS.new_tokens, FLAGS.num_draft_tokens
  prompts = [_prompt(tokenizer, spec) for spec in FLAGS.prompts]
  longest = max(len(p) for p in prompts)
  args = dict(num_slots=len(prompts), page_size=16, max_len=longest + n,
              max_prompt_len=longest, num_pages=len(prompts) * ((longest + n) // 16 + 1))
  systems = {"batcher_plain": ContinuousBatcher(model, **args),
             "batcher_prompt_lookup": ContinuousBatcher(
                 model, speculative=speculative.PromptLookup(k, FLAGS.max_ngram_size), **args)}
  if FLAGS.draft_layers:
    systems[f"batcher_draft_{FLAGS.draft_layers}_layers"] = ContinuousBatcher(
        model, speculative=speculative.DraftModel(_truncated(model, FLAGS.draft_layers), k),
        **args)
  requests = [(i, p, n) for i, p in enumerate(prompts)]
  wall, out, steps = {s: [] for s in systems}, {}, {}
  for r in range(FLAGS.rounds + 1):  # round 0 compiles: not timed
    for name, b in systems.items():
      before = b.steps
      seconds, _, out[name] = timing.timed(b.run, requests)
      steps[name] = b.steps - before
      if r:
        wall[name].append(seconds)
  plain_s = statistics.median(wall["batcher_plain"])
  for name, b in systems.items():
    same = all(np.array_equal(out["batcher_plain"][i].tokens, out[name][i].tokens)
               for i, _, _ in requests)
    stats = b.spec_stats
    median = statistics.median(wall[name])
    print(json.dumps(dict(
        system=name, prompts=FLAGS.prompts, prompt_lens=[len(p) for p in prompts],
        new_tokens=n, k=k, rounds=FLAGS.rounds, load_avg=os.getloadavg()[0],
        **timing.stats("run_s", wall[name]), steps=steps[name], speedup_vs_plain=plain_s / median,
        tokens_per_slot_pass=1 + stats["accepted"] / max(stats["passes"], 1),
        tokens_equal=same)))


def _prompt(tokenizer, spec: str) -> np.ndarray:
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top
  mode, topic = spec.split(":")
  ids = tokenizer.encode(pydoc_data.topics.topics[topic], add_special_tokens=False)
  text = tokenizer.decode(ids[:FLAGS.prompt_tokens])
  if mode == "continue":
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
  if mode != "chat":
    raise cli.UserError(f"--prompts mode must be continue or chat; got {mode!r}")
  rendered = tokenizer.apply_chat_template(
      [{"role": "user", "content": text + "\n\nExplain the documentation above, quoting it."}])
  return np.asarray(tokenizer.encode(rendered, add_special_tokens=False), np.int32)


def _truncated(model, num_layers: int):
  """The model's first `num_layers` layers, embedding and head (shared weights)."""
  return model.truncated(num_layers)


class _HFPeer:
  """`experiments/benchmarks/peers/hf_prompt_lookup.py` as a subprocess (JSON lines)."""

  def __init__(self, request):
    self._file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(request, self._file)
    self._file.close()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    self.proc = subprocess.Popen(
        [FLAGS.peer_python, "-m", "experiments.benchmarks.peers.hf_prompt_lookup", "--request",
         self._file.name], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.info = json.loads(self.proc.stdout.readline())

  def __call__(self):
    self.proc.stdin.write("run\n")
    self.proc.stdin.flush()
    return json.loads(self.proc.stdout.readline())

  def close(self):
    self.proc.stdin.write("quit\n")
    self.proc.stdin.flush()
    self.proc.wait(timeout=60)
    os.unlink(self._file.name)


def main(argv):
  """Runs the benchmark the flags select (module doc); one JSON line per measurement."""
  del argv
  if FLAGS.memory:
    memory()
    return
  if FLAGS.verify_cost:
    verify_cost()
    return
  if FLAGS.batcher:
    batcher()
    return
  model, tokenizer = pretrained.from_pretrained(FLAGS.model, dtype=jnp.float32,
                                                param_dtype=FLAGS.param_dtype)
  k, n = FLAGS.num_draft_tokens, FLAGS.new_tokens
  drafters = {"prompt_lookup": speculative.PromptLookup(k, FLAGS.max_ngram_size)}
  if FLAGS.draft_layers:
    drafters[f"draft_{FLAGS.draft_layers}_layers"] = speculative.DraftModel(
        _truncated(model, FLAGS.draft_layers), k)
  env = dict(platform=platform.platform(), jax=jax.__version__,
             device=str(jax.devices()[0]), cpus=os.cpu_count(),
             load_avg=os.getloadavg()[0])
  for spec in FLAGS.prompts:
    prompt = _prompt(tokenizer, spec)[None]
    lengths = np.array([prompt.shape[1]], np.int32)
    caches = model.init_caches(1, prompt.shape[1] + n + k, jnp.dtype(FLAGS.cache_dtype))
    _, first, caches, key = timing.timed_prefill(model, prompt, lengths, caches)
    copy = lambda: jax.tree.map(jnp.copy, caches)

    def plain():
      return timing.timed_decode(model, first, copy(), n, key)[0::2][:2]

    def spec_run(drafter):
      seconds, _, (tokens, _, _, stats) = timing.timed(
          speculative.decode, model, first, copy(), prompt, lengths, n, drafter)
      return seconds, tokens, stats

    peer = None
    if FLAGS.peers:
      peer = _HFPeer({"gguf": str(hub.resolve(FLAGS.model)), "prompt": prompt[0].tolist(),
                      "new_tokens": n, "num_draft_tokens": k,
                      "max_ngram_size": FLAGS.max_ngram_size, "threads": os.cpu_count()})
    times = {name: [] for name in ["plain", *drafters]}
    hf = []
    want = None
    for r in range(FLAGS.rounds + 1):  # round 0 compiles: not timed
      if peer is not None and r % 2:  # odd rounds: the peer first
        out = peer()
        if r:
          hf.append(out)
      seconds, want = plain()
      times["plain"].append(seconds)
      for name, drafter in drafters.items():
        seconds, tokens, stats = spec_run(drafter)
        times[name].append(seconds)
        same = bool(np.array_equal(np.asarray(tokens), np.asarray(want)))
        differ = np.flatnonzero(np.asarray(tokens)[0] != np.asarray(want)[0])
        per_pass = 1 + int(stats["accepted"][0]) / max(int(stats["passes"][0]), 1)
        times[name + "/info"] = dict(equal_to_plain=same, tokens_per_pass=per_pass,
                                     first_divergence=int(differ[0]) if len(differ) else None,
                                     passes=int(stats["passes"][0]))
      if peer is not None and not r % 2:
        out = peer()
        if r:
          hf.append(out)
    plain_s = statistics.median(times["plain"][1:])
    base = dict(prompt=spec, prompt_len=int(prompt.shape[1]), new_tokens=n, k=k,
                max_ngram_size=FLAGS.max_ngram_size, rounds=FLAGS.rounds,
                param_dtype=FLAGS.param_dtype, cache_dtype=FLAGS.cache_dtype, **env)
    print(json.dumps(dict(base, system="kvattn_plain", **timing.stats("decode_s",
                                                                      times["plain"][1:]),
                          decode_tokens_per_s=(n - 1) / plain_s)))
    for name in drafters:
      median = statistics.median(times[name][1:])
      print(json.dumps(dict(base, system=f"kvattn_{name}",
                            **timing.stats("decode_s", times[name][1:]),
                            decode_tokens_per_s=(n - 1) / median,
                            speedup_vs_plain=plain_s / median, **times[name + "/info"])))
    if peer is not None:
      peer.close()
      for system in ("plain", "prompt_lookup"):
        decode = [h[system + "_s"] - h[system + "_first_s"] for h in hf]
        median = statistics.median(decode)
        print(json.dumps(dict(base, system=f"hf_{system}", **timing.stats("decode_s", decode),
                              decode_tokens_per_s=(n - 1) / median,
                              vs_kvattn_plain=plain_s / median,
                              equal_to_kvattn_plain=bool(np.array_equal(
                                  np.asarray(hf[-1][system + "_tokens"]),
                                  np.asarray(want)[0])))))


if __name__ == "__main__":
  cli.run(main)
