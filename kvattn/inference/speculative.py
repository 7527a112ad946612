"""Speculative decoding with greedy acceptance: draft k tokens, verify them in one pass.

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318), greedy case:
the model runs once over `[last, d_1..d_k]`, takes its greedy `g_0..g_k`, accepts the longest
prefix with `d_{i+1} == g_i` (a tokens) and emits `g_0..g_a`, what plain greedy emits. Each
cache is written through a `kvattn.caches.transaction` and keeps `a + 1` tokens per row.
Drafters: `PromptLookup` (Saxena 2023; transformers' `prompt_lookup_num_tokens`: the tokens
after the latest earlier occurrence of the trailing n-gram, else the last token repeated)
and `DraftModel` (a smaller model with its own dense caches). One `lax.while_loop`, k
static. Sampling (Leviathan et al.'s rejection scheme) is not offered.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import _checks
from kvattn.caches import transaction
from kvattn.caches import capabilities


@dataclasses.dataclass(frozen=True)
class PromptLookup:
  """Prompt lookup drafting (module doc).

  num_draft_tokens: k, tokens drafted per verify pass (>= 1).
  max_ngram_size: longest trailing n-gram matched (>= 1; transformers' default 2).
  min_ngram_size: shortest (1 <= min <= max).
  """

  num_draft_tokens: int = 4
  max_ngram_size: int = 3
  min_ngram_size: int = 1

  def __post_init__(self):
    _checks.positive_int("num_draft_tokens", self.num_draft_tokens)
    _checks.positive_int("max_ngram_size", self.max_ngram_size)
    _checks.positive_int("min_ngram_size", self.min_ngram_size)
    if self.min_ngram_size > self.max_ngram_size:
      raise ValueError(f"min_ngram_size must be <= max_ngram_size = {self.max_ngram_size}; got "
                       f"{self.min_ngram_size}")


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel:
  """A draft model (module doc).

  model: a `kvattn.Transformer` with the target's vocabulary; its caches are dense
    (`model.init_caches(..., local_layers="full")`), rolled back by lengths.
  num_draft_tokens: k, tokens drafted per verify pass (>= 1).
  """

  model: Any
  num_draft_tokens: int = 4

  def __post_init__(self):
    _checks.positive_int("num_draft_tokens", self.num_draft_tokens)
    if not (hasattr(self.model, "hidden") and hasattr(self.model, "logits_from_hidden")):
      raise TypeError(f"model must be a kvattn.Transformer; got {type(self.model).__name__}")


Speculative = PromptLookup | DraftModel


def check(speculative: Any, vocab_size: int) -> Speculative:
  """`speculative` checked against the target's vocabulary; TypeError / ValueError naming it."""
  if not isinstance(speculative, (PromptLookup, DraftModel)):
    raise TypeError(f"speculative must be a PromptLookup, a DraftModel or None; got "
                    f"{type(speculative).__name__}")
  if isinstance(speculative, DraftModel):
    got = int(getattr(speculative.model, "vocab_size"))
    if got != vocab_size:
      raise ValueError(f"speculative.model must share the target's vocabulary ({vocab_size} "
                       f"tokens); got vocab_size {got}")
  return speculative


# ----------------------------------------------------------------------------------------------
# Drafters (traced).


def prompt_lookup_drafts(history: jax.Array, end: jax.Array, lookup: PromptLookup) -> jax.Array:
  """`i32[B, k]` drafts from the text `history[b, :end[b]]` (`history: i32[B, W]`,
  `end: i32[B]` >= 1): the tokens after the most recent earlier occurrence of the
  longest trailing n-gram that occurs (module doc)."""
  batch, width = history.shape
  k = lookup.num_draft_tokens
  i = jnp.arange(width, dtype=jnp.int32)[None, :]
  padded = jnp.concatenate([history, jnp.zeros((batch, lookup.max_ngram_size), jnp.int32)], 1)
  start = jnp.full((batch,), -1, jnp.int32)  # where the draft is copied from
  for n in range(lookup.max_ngram_size, lookup.min_ngram_size - 1, -1):
    match = (i + n < end[:, None]) & (end[:, None] > n)  # an earlier occurrence, not the tail
    for j in range(n):
      tail = jnp.take_along_axis(history, jnp.maximum(end - n + j, 0)[:, None], axis=1)
      match &= padded[:, j:j + width] == tail
    latest = jnp.max(jnp.where(match, i, -1), axis=1)
    start = jnp.where((start < 0) & (latest >= 0), latest + n, start)
  found = start >= 0
  period = jnp.maximum(end - start, 1)[:, None]  # copy periodically past the end of the text
  src = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :] % period
  src = jnp.where(found[:, None], src, end[:, None] - 1)  # no match: the last token
  return jnp.take_along_axis(history, jnp.clip(src, 0, width - 1), axis=1)


def _draft_model_drafts(draft_graphdef, draft_state, draft_caches, history, end, active, k):
  """`(i32[B, k] drafts, caches)`: the draft model catches up on the text its caches
  lack (1 or 2 tokens per row: a T = 2 step, right-padded) and drafts greedily."""
  model = nnx.merge(draft_graphdef, draft_state)
  held = draft_caches[0].lengths  # tokens the draft caches hold; the text has `end`
  missing = jnp.where(active, end - held, 0)  # 1, or 2 after a fully accepted pass
  idx = held[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
  tokens = jnp.take_along_axis(history, jnp.clip(idx, 0, history.shape[1] - 1), axis=1)
  h, draft_caches = model.hidden(tokens, draft_caches, new_lengths=missing)
  rows = jnp.arange(history.shape[0])
  first = jnp.argmax(model.logits_from_hidden(h[rows, jnp.maximum(missing - 1, 0)]),
                     axis=-1).astype(jnp.int32)

  def step(carry, _):
    token, caches = carry
    h, caches = model.hidden(token[:, None], caches, new_lengths=active.astype(jnp.int32))
    nxt = jnp.argmax(model.logits_from_hidden(h[:, 0]), axis=-1).astype(jnp.int32)
    return (nxt, caches), nxt

  (_, draft_caches), rest = jax.lax.scan(step, (first, draft_caches), None, length=k - 1)
  drafts = jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
  return drafts, draft_caches


# ----------------------------------------------------------------------------------------------
# The compiled loop.


@functools.partial(jax.jit, static_argnames=("graphdef", "lookup", "draft_graphdef", "k",
                                             "max_new_tokens"),
                   donate_argnames=("caches",))
def _decode(graphdef, state, caches, first, history, prompt_lengths, draft_state, draft_caches,
            *, lookup, draft_graphdef, k, max_new_tokens, eos_id, pad_id):
  batch = first.shape[0]
  rows = jnp.arange(batch)
  span = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  # room for a pass that starts at the last slot: k + 1 tokens past max_new_tokens
  tokens = jnp.full((batch, max_new_tokens + k + 1), pad_id, jnp.int32).at[:, 0].set(first)
  done = (first == eos_id) if eos_id is not None else jnp.zeros((batch,), bool)
  done = done | (max_new_tokens <= 1)
  count = jnp.ones((batch,), jnp.int32)  # tokens generated; the last is not in the caches
  stats = dict(passes=jnp.zeros((batch,), jnp.int32), accepted=jnp.zeros((batch,), jnp.int32))

  def cond(carry):
    return ~jnp.all(carry[2])

  def body(carry):
    tokens, count, done, history, caches, draft_caches, stats = carry
    active = ~done
    end = prompt_lengths + count  # tokens of text; the last one, history[end - 1], is fed now
    last = history[rows, end - 1]
    if lookup is not None:
      drafts = prompt_lookup_drafts(history, end, lookup)
    else:
      drafts, draft_caches = _draft_model_drafts(draft_graphdef, draft_state, draft_caches,
                                                 history, end, active, k)
    model = nnx.merge(graphdef, state)
    fed = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, k + 1]
    new_lengths = jnp.where(active, k + 1, 0)
    h, drafted = model.hidden(fed, transaction.begin_all(caches), new_lengths=new_lengths)
    greedy = jnp.argmax(model.logits_from_hidden(h), axis=-1).astype(jnp.int32)  # [B, k + 1]
    accepted = jnp.sum(jnp.cumprod(drafts == greedy[:, :k], axis=1), axis=1).astype(jnp.int32)
    emit = jnp.minimum(accepted + 1, max_new_tokens - count)
    if eos_id is not None:  # stop after the first EOS among the emitted tokens
      is_eos = (greedy == eos_id) & (span < emit[:, None])
      emit = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, emit)
    emit = jnp.where(active, emit, 0)
    caches = transaction.commit_all(drafted, emit)  # last + the emitted drafts
    if lookup is None:  # the draft caches keep what the text confirms
      held = jnp.where(active, end + jnp.minimum(emit, k) - 1, draft_caches[0].lengths)
      draft_caches = tuple(c.replace(lengths=jnp.minimum(c.lengths, held))
                           for c in draft_caches)
    out = jnp.where(span < emit[:, None], count[:, None] + span, tokens.shape[1])
    tokens = tokens.at[rows[:, None], out].set(greedy, mode="drop")
    at = jnp.where(span < emit[:, None], end[:, None] + span, history.shape[1])
    history = history.at[rows[:, None], at].set(greedy, mode="drop")
    count = count + emit
    emitted_eos = jnp.any((greedy == eos_id) & (span < emit[:, None]), axis=1) \
        if eos_id is not None else False
    done = done | (count >= max_new_tokens) | emitted_eos
    stats = dict(passes=stats["passes"] + active.astype(jnp.int32),
                 accepted=stats["accepted"] + jnp.where(active, emit - 1, 0))
    return tokens, count, done, history, caches, draft_caches, stats

  carry = (tokens, count, done, history, tuple(caches), draft_caches, stats)
  tokens, count, _, _, caches, _, stats = jax.lax.while_loop(cond, body, carry)
  return tokens[:, :max_new_tokens], count, caches, stats


def decode(model: nnx.Module, first_tokens: jax.Array, caches: Sequence[Any],
           prompts: np.ndarray, prompt_lengths: np.ndarray, max_new_tokens: int,
           speculative: Speculative, *, eos_id: int | None = None, pad_id: int = 0
           ) -> tuple[jax.Array, jax.Array, tuple[Any, ...], dict[str, jax.Array]]:
  """The speculative decode loop after `kvattn.inference.generation.prefill` (greedy).

  Args:
    model: the target model passed to `prefill`.
    first_tokens: `i32[B]` tokens `prefill` sampled.
    caches: the caches `prefill` returned, with room for k more tokens; donated.
    prompts, prompt_lengths: `i32[B, T]` right-padded prompts and `i32[B]` lengths.
    max_new_tokens: tokens to return per sequence, the first included.
    speculative: a `PromptLookup` or a `DraftModel`.
    eos_id, pad_id: as in `kvattn.generate`.

  Returns:
    `(tokens i32[B, max_new_tokens], lengths i32[B], caches, stats)`; `stats["passes"]`
    and `stats["accepted"]` (`i32[B]`): verify passes and accepted drafts per row.
  """
  prompts = np.asarray(prompts, np.int32)
  prompt_lengths = np.asarray(prompt_lengths, np.int32)
  batch, width = prompts.shape
  k = speculative.num_draft_tokens
  history = np.zeros((batch, width + max_new_tokens + k + 1), np.int32)
  history[:, :width] = np.where(np.arange(width)[None] < prompt_lengths[:, None], prompts, 0)
  history = jnp.asarray(history).at[np.arange(batch), prompt_lengths].set(
      jnp.asarray(first_tokens, jnp.int32))
  graphdef, state = nnx.split(model)
  lookup, draft_graphdef, draft_state, draft_caches = None, None, None, ()
  if isinstance(speculative, PromptLookup):
    lookup = speculative
  else:
    draft = speculative.model
    draft_graphdef, draft_state = nnx.split(draft)
    # Full-length caches on every layer: rings (the local layers' default) cannot roll back
    # by lengths.
    draft_caches = draft.init_caches(batch, width + max_new_tokens + k + 1, local_layers="full")
    if not all(capabilities.rollback(c) == "lengths" for c in draft_caches):
      raise ValueError("speculative.model must build caches that roll back by lengths "
                       "(dense, latent, paged); got "
                       f"{sorted({type(c).__name__ for c in draft_caches})}")
    draft_caches = _draft_prefill(draft_graphdef, draft_state, tuple(draft_caches),
                                  jnp.asarray(prompts), jnp.asarray(prompt_lengths))
  return _decode(graphdef, state, tuple(caches), jnp.asarray(first_tokens, jnp.int32), history,
                 jnp.asarray(prompt_lengths), draft_state, draft_caches, lookup=lookup,
                 draft_graphdef=draft_graphdef, k=k, max_new_tokens=max_new_tokens,
                 eos_id=None if eos_id is None else np.int32(eos_id), pad_id=np.int32(pad_id))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("caches",))
def _draft_prefill(graphdef, state, caches, prompts, prompt_lengths):
  _, caches = nnx.merge(graphdef, state).hidden(prompts, caches, new_lengths=prompt_lengths)
  return caches
