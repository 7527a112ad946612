"""Per-layer cache layout vs full allocation: cache bytes per sequence, decode speed, tokens.

    python -m experiments.benchmarks.per_layer_layout                       # Gemma 3 270M
    python -m experiments.benchmarks.per_layer_layout --context=512 --out=/tmp/layout.md
    python -m experiments.benchmarks.per_layer_layout --context=0 --batcher_slots=2 \
        --random_weights --model=gemma3-270m --batcher_prompt=32 --new_tokens=4 --repeats=1

Layouts (`model.init_caches(..., local_layers=)`): "full" gives every layer a dense cache of
the sequence's length; "ring" gives each layer with a sliding window W shorter than the length
(Gemma 3: the 5 local layers of every 6, W = 512) a `RingKVCache` of W slots and the global
layers the dense cache.

  bytes       cache storage bytes of one sequence at each `--lengths` (keys + values, f32 or
              `--cache_dtype`), from the shapes `init_caches` builds (jax.eval_shape, nothing
              allocated), both layouts, and their ratio;
  decode      one prompt of `--context` tokens of the default corpus prefilled once per layout
              (`--fill=random`: no prefill; every layer's cache holds `--context` tokens of
              random keys and values, the rings the same tokens' last W -- what a prefill would
              leave in them -- so the layouts see the same attention inputs; for contexts whose
              prefill is too slow to run here, e.g. 32k on 2 cores; the speed is the real
              decode step's, the tokens mean nothing beyond the layouts' agreement),
              then `--new_tokens` greedy steps through `kvattn.generate`'s compiled decode loop
              (`experiments.framework.timing.timed_decode`, caches donated), `--repeats`
              samples taken round-robin across the layouts so background load hits both alike;
              median tokens/s and whether both layouts produced the same tokens.
  batcher     (`--batcher_slots` > 0) `kvattn.ContinuousBatcher` with each layout: the
              "full" batcher gives every layer a page pool, the "ring" one a ring of W slots
              per batch slot for the local layers and pools for the global layers only; its
              cache bytes (pools sized for every slot at `--batcher_max_len` tokens),
              then `--batcher_slots` prompts of `--batcher_prompt` tokens joined and decoded
              `--new_tokens` steps, `--repeats` rounds alternating the layouts: median decode
              tokens/s (all slots) and whether the layouts' tokens agree.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.evals import models
from experiments.evals import text
from experiments.framework import cli
from experiments.framework import timing

LAYOUTS = ("full", "ring")


def _parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="gemma3-270m", help="registered name or checkpoint path")
  p.add_argument("--random_weights", action="store_true",
                 help="the architecture with random weights (no fetch; bytes only are real)")
  p.add_argument("--lengths", default="4096,32768", help="sequence lengths of the bytes table")
  p.add_argument("--cache_dtype", default="float32")
  p.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding "
                 "(0: bytes only)")
  p.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                 help="how the decode section's caches get their --context tokens (module doc)")
  p.add_argument("--new_tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--batcher_slots", type=int, default=0,
                 help="ContinuousBatcher slots of the batcher section (0: skip it)")
  p.add_argument("--batcher_prompt", type=int, default=256, help="prompt tokens per slot")
  p.add_argument("--batcher_max_len", type=int, default=0,
                 help="tokens per slot the pools are sized for (0: prompt + new tokens)")
  p.add_argument("--out", default=None, help="also write the markdown here")
  return p


def storage_bytes(model, length: int, dtype, layout: str) -> int:
  """Bytes of the storage arrays (values and scales) of one sequence's caches."""
  caches = jax.eval_shape(lambda: model.init_caches(1, length, dtype, local_layers=layout))
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
             for c in caches for a in c.storage_arrays())


def random_fill(model, context: int, capacity: int, dtype) -> dict:
  """Both layouts' caches of one sequence holding `context` tokens of random keys and values
  (N(0, 1), seed 0): the "full" layout's dense caches, and the "ring" layout with each ring
  holding the same tokens' newest W in their slots (token p in slot p % W) and the global
  layers the same dense caches. Returns `{layout: caches}`."""
  from kvattn.caches.window import RingKVCache  # pylint: disable=g-import-not-at-top
  full = model.init_caches(1, capacity, dtype, local_layers="full")
  ring = model.init_caches(1, capacity, dtype, local_layers="ring")
  lengths = jnp.asarray([context], jnp.int32)
  filled_full, filled_ring = [], []
  for i, (f, r) in enumerate(zip(full, ring)):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(0), i))
    k = jnp.where(jnp.arange(capacity)[:, None] < context,
                  jax.random.normal(keys[0], f.k.shape), 0).astype(f.k.dtype)
    v = jnp.where(jnp.arange(capacity)[:, None] < context,
                  jax.random.normal(keys[1], f.v.shape), 0).astype(f.v.dtype)
    f = f.replace(k=k, v=v, lengths=lengths)
    filled_full.append(f)
    if isinstance(r, RingKVCache):
      pos = jnp.asarray(r.expected_pos(np.asarray([context])))  # [1, W]
      take = jnp.maximum(pos, 0)[:, None, :, None]
      r = r.replace(k=jnp.take_along_axis(k, take, axis=2), v=jnp.take_along_axis(v, take, axis=2),
                    pos=pos, lengths=lengths)
    else:
      r = f
    filled_ring.append(r)
  return {"full": tuple(filled_full), "ring": tuple(filled_ring)}


def batcher_section(model, tok, args, dtype) -> list[str]:
  """The batcher rows of the report (module doc)."""
  import kvattn  # pylint: disable=g-import-not-at-top
  slots, n, new = args.batcher_slots, args.batcher_prompt, args.new_tokens
  max_len = args.batcher_max_len or n + new
  if max_len < n + new:
    raise ValueError(f"--batcher_max_len must be >= --batcher_prompt + --new_tokens = {n + new}; "
                     f"got {max_len}")
  page_size = 16
  pages = slots * -(-max_len // page_size)
  ids = (text.corpus_tokens(tok, slots * n) if tok is not None else
         np.random.default_rng(0).integers(3, model.vocab_size, slots * n))
  prompts = np.asarray(ids, np.int32).reshape(slots, n)
  batchers, nbytes = {}, {}
  for layout in LAYOUTS:
    b = kvattn.ContinuousBatcher(model, num_slots=slots, num_pages=pages, page_size=page_size,
                                 max_len=max_len, max_prompt_len=n, dtype=dtype,
                                 local_layers=layout)
    nbytes[layout] = sum(a.nbytes for c in b.caches for a in c.storage_arrays())
    b.run([("warm", prompts[0], 2)])  # compiles join and step
    batchers[layout] = b
  rates, tokens = {layout: [] for layout in LAYOUTS}, {}
  for _ in range(args.repeats):
    for layout in LAYOUTS:
      b = batchers[layout]
      for i in range(slots):
        b.add(i, prompts[i], new)
      done, steps, t0 = {}, 0, time.perf_counter()
      while b.active:
        for f in b.step():
          done[f.request_id] = f
        steps += 1
      seconds = time.perf_counter() - t0
      rates[layout].append(slots * steps / seconds)
      tokens[layout] = [done[i].tokens.tolist() for i in range(slots)]
  return ["", f"ContinuousBatcher, {slots} slots, pools of {pages} pages of {page_size} tokens "
          f"(every slot at {max_len} tokens), prompts of {n} tokens, {new} tokens each, median "
          f"of {args.repeats} rounds alternating the layouts:", "",
          "| layout | cache bytes | decode tok/s (all slots) | same tokens as full |",
          "|---|---|---|---|"] + [
              f"| {layout} | {nbytes[layout]:,} B ({nbytes[layout] / 2**20:.1f} MiB) | "
              f"{float(np.median(rates[layout])):.1f} | "
              f"{'yes' if tokens[layout] == tokens['full'] else 'NO'} |" for layout in LAYOUTS]


def main(argv=None) -> None:
  """Prints cache bytes per sequence (full vs per-layer layout) and, with `--context`, the
  decode tokens/s of both layouts, one JSON line per row."""
  args = _parser().parse_args(argv)
  model, tok = models.load_model(args.model, random_weights=args.random_weights)
  dtype = jnp.dtype(args.cache_dtype)
  windows = [layer.attn.window for layer in model.layers]
  lines = [f"model {args.model}: {len(windows)} layers, windows {windows}, cache dtype "
           f"{dtype.name}", "",
           "| tokens | full allocation | per-layer layout | ratio |", "|---|---|---|---|"]
  for length in (int(n) for n in args.lengths.split(",")):
    full, ring = (storage_bytes(model, length, dtype, layout) for layout in LAYOUTS)
    lines.append(f"| {length:,} | {full:,} B ({full / 2**20:.1f} MiB) | {ring:,} B "
                 f"({ring / 2**20:.1f} MiB) | {full / ring:.2f}x |")
  if args.context:
    ids = (text.corpus_tokens(tok, args.context) if tok is not None else
           np.random.default_rng(0).integers(3, model.vocab_size, args.context))
    prompts = jnp.asarray(np.asarray(ids, np.int32)[None])
    lengths = jnp.asarray([args.context], jnp.int32)
    capacity = args.context + args.new_tokens
    state = {}
    filled = random_fill(model, args.context, capacity, dtype) if args.fill == "random" else {}
    for layout in LAYOUTS:
      if args.fill == "random":
        first, caches, key = prompts[:, -1], filled[layout], jax.random.key(0)
      else:
        caches = model.init_caches(1, capacity, dtype, local_layers=layout)
        _, first, caches, key = timing.timed_prefill(model, prompts, lengths, caches)
      state[layout] = (first, caches, key)
      timing.timed_decode(model, first, jax.tree.map(jnp.copy, caches), args.new_tokens, key)
    rates, tokens = {layout: [] for layout in LAYOUTS}, {}
    for _ in range(args.repeats):
      for layout in LAYOUTS:
        first, caches, key = state[layout]
        seconds, _, out, _, _ = timing.timed_decode(model, first, jax.tree.map(jnp.copy, caches),
                                                    args.new_tokens, key)
        rates[layout].append((args.new_tokens - 1) / seconds)
        tokens[layout] = np.asarray(out).tolist()
    same = tokens["full"] == tokens["ring"]
    how = ("prompt" if args.fill == "prefill" else
           "context of random keys and values (--fill=random, no prefill)")
    lines += ["", f"decode after a {args.context}-token {how}, {args.new_tokens} greedy tokens, "
              f"median of {args.repeats} interleaved samples:", "",
              "| layout | decode tok/s | same tokens as full |", "|---|---|---|"]
    for layout in LAYOUTS:
      lines.append(f"| {layout} | {float(np.median(rates[layout])):.1f} | "
                   f"{'yes' if tokens[layout] == tokens['full'] else 'NO'} |")
    if tok is not None and args.fill == "prefill":
      lines.append(f"\ngreedy text: {tok.decode(tokens['ring'][0])!r}")
    if not same:
      lines.append("WARNING: the layouts' greedy tokens differ")
  if args.batcher_slots:
    lines += batcher_section(model, tok, args, dtype)
  cli.print_and_save("\n".join(lines), args.out)


if __name__ == "__main__":
  cli.run_plain(main)
