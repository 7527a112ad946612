"""Streaming evaluation through any caches: per-token NLL, passkey retrieval, greedy decode.

Each takes caches of any kind of the cache protocol, so every family, benchmark and
notebook scores a cache kind the same way: `streaming_nll` (StreamingLLM's evaluation:
the text fed `chunk` tokens per forward pass; `streaming_scores` also keeps each position's
top-1 token, which `top1_agreement` compares with a reference's), `passkey_correct` (chunked prefill, greedy
decode, key found or not) and `greedy` (chunked prefill, then `kvattn.generate`'s compiled
decode loop with the caches donated, timed as `experiments.benchmarks.real` times it).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.framework import timing


@functools.lru_cache(maxsize=8)
def step_fn(graphdef):
  """Jitted `(state, caches, tokens, new_lengths, targets) -> (nll, argmax, caches)` through the
  model's own call (per-layer caches of any protocol kind; `streaming_nll`, `passkey_correct`)."""

  @jax.jit
  def step(state, caches, tokens, new_lengths, targets):
    logits, caches = nnx.merge(graphdef, state)(tokens, caches, new_lengths=new_lengths)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32), caches

  return step


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
  nll, _, caches = streaming_scores(model, caches, ids, chunk)
  return nll, caches


def streaming_scores(model, caches, ids: np.ndarray, chunk: int
                     ) -> tuple[np.ndarray, np.ndarray, Any]:
  """`streaming_nll` that also keeps each position's top-1 prediction (the same forward passes).

  Returns:
    `(nll f64[n], argmax i32[n], caches)`: position i's negative log-likelihood (nats) of
    `ids[i + 1]`, the argmax over the vocabulary of its logits (first index on a tie, as
    `np.argmax`), and the caches after. `top1_agreement` compares two such argmaxes.
  """
  graphdef, state = nnx.split(model)
  step = step_fn(graphdef)
  (nll, argmax), caches = _feed(lambda c, *args: _pair(step(state, c, *args)), caches, ids,
                                len(ids) - 1, chunk, ints=1)
  return nll, argmax, caches


def _pair(out):
  nll, argmax, caches = out
  return (nll, argmax), caches


def top1_agreement(argmax: np.ndarray, reference: np.ndarray) -> float:
  """Teacher-forced top-1 agreement: the fraction of positions whose argmax equals the reference's.

  Both come from the same held-out text fed to each model (teacher forcing, as
  `streaming_scores` feeds it), so one near-tie flips one position, not the rest of a
  continuation (unlike greedy agreement).

  Args:
    argmax: `i32[n]` the point's top-1 token at each position.
    reference: `i32[n]` the reference's top-1 token at the same positions.

  Returns:
    The fraction in [0, 1] (float).

  Raises:
    ValueError: the shapes differ, are not 1-D, or n = 0.
  """
  argmax, reference = np.asarray(argmax), np.asarray(reference)
  if argmax.ndim != 1 or argmax.shape != reference.shape:
    raise ValueError(f"argmax and reference must be 1-D of the same length; got shapes "
                     f"{argmax.shape} and {reference.shape}")
  if not argmax.size:
    raise ValueError("argmax must hold at least one position; got 0")
  return float(np.mean(argmax == reference))


def feed_chunks(nll_step, caches, ids: np.ndarray, count: int,
                chunk: int) -> tuple[np.ndarray, Any]:
  """Feeds `ids[:count]` (batch 1) `chunk` tokens per call of `nll_step(caches, tokens
  i32[1, chunk], lengths i32[1], targets i32[1, chunk]) -> (nll [1, chunk], caches)`, the
  last chunk right-padded; returns `(nll f64[count], caches)`."""
  (nll,), caches = _feed(lambda c, *args: _one(nll_step(c, *args)), caches, ids, count, chunk,
                         ints=0)
  return nll, caches


def _one(out):
  nll, caches = out
  return (nll,), caches


def _feed(step, caches, ids: np.ndarray, count: int, chunk: int, ints: int):
  """`feed_chunks` for a step returning `((nll, *others), caches)`, each output `[1, chunk]`:
  returns `((nll f64[count], *others i32[count]), caches)` (`ints` others)."""
  outs = [np.zeros(count, np.float64)] + [np.zeros(count, np.int32) for _ in range(ints)]
  for s in range(0, count, chunk):
    e = min(count, s + chunk)
    toks = np.zeros((1, chunk), np.int32)
    tgts = np.zeros((1, chunk), np.int32)
    toks[0, :e - s], tgts[0, :e - s] = ids[s:e], ids[s + 1:e + 1]
    out, caches = step(caches, jnp.asarray(toks), jnp.array([e - s], jnp.int32),
                       jnp.asarray(tgts))
    for o, x in zip(outs, out, strict=True):
      o[s:e] = np.asarray(x[0, :e - s])
  return tuple(outs), caches


def padded_rows(prompts: Sequence[Sequence[int]], chunk: int) -> tuple[np.ndarray, np.ndarray]:
  """`(tokens i32[B, P], lengths i32[B])`: the prompts right-padded with 0 to P, the longest
  length rounded up to a multiple of `chunk`."""
  lengths = np.array([len(p) for p in prompts], np.int32)
  toks = np.zeros((len(prompts), -(-int(lengths.max()) // chunk) * chunk), np.int32)
  for b, p in enumerate(prompts):
    toks[b, :len(p)] = p
  return toks, lengths


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
  step = step_fn(graphdef)
  toks, lengths = padded_rows(prompts, chunk)
  batch, padded = toks.shape
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


def greedy(model, caches, prompt: np.ndarray, new_tokens: int, chunk: int
           ) -> tuple[np.ndarray, float]:
  """Greedy continuation of one prompt through `caches` (batch 1).

  The prompt goes in `chunk` tokens per forward pass (`step_fn`), then `new_tokens - 1` tokens through `kvattn.generate`'s
  compiled decode loop with the caches donated (`kvattn.inference.decode`, one
  XLA program, no Python dispatch per token), as `bench_real` times it. A first
  run on a copy of the caches compiles the loop; the second is timed.

  Returns:
    `(i32[new_tokens] tokens, seconds of the timed decode loop)` (0.0 when
    `new_tokens` < 2).
  """
  graphdef, state = nnx.split(model)
  step = step_fn(graphdef)
  last = None
  for s in range(0, len(prompt), chunk):
    part = prompt[s:s + chunk]
    toks = np.zeros((1, chunk), np.int32)
    toks[0, :len(part)] = part
    blk = jnp.asarray(toks)
    _, arg, caches = step(state, caches, blk, jnp.array([len(part)], jnp.int32), blk)
    last = int(arg[0, len(part) - 1])
  if new_tokens < 2:
    return np.asarray([last], np.int32), 0.0
  first = jnp.array([last], jnp.int32)
  timing.timed_decode(model, first, jax.tree.map(jnp.copy, caches), new_tokens,
                      jax.random.key(0))  # compiles
  seconds, _, tokens, _, _ = timing.timed_decode(model, first, caches, new_tokens,
                                                 jax.random.key(0))
  return np.asarray(tokens[0], np.int32), seconds
