"""Cache transactions: write T draft tokens tentatively, then keep the first `keep[b]`.

Speculative decoding (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
2302.01318) writes T draft tokens into every layer's cache, verifies them in one forward
pass and must then drop the rejected ones. Here that is a property of the cache protocol,
so every kind -- including one registered later -- rolls back exactly:
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvattn.caches import protocol

COPY, KIND = "copy", "kind"
"""Journal kinds: the cache itself (generic default) or the kind's own `draft_journal`."""


def chunk_equals_steps(cache: Any) -> bool:
  """True when `cache` declares that a chunk through `update_attend` equals one-token steps
  (attribute or property `chunk_equals_steps`; default False: verify stepwise)."""
  return bool(getattr(cache, "chunk_equals_steps", False))


@struct.dataclass
class Draft:
  """One layer's cache inside a transaction (`begin` ... `commit`).

  Attributes:
    cache: the layer's cache; after the write, the cache holding all T draft tokens.
    journal: what `commit` needs to undo the write (None before it): the kind's
      `draft_journal(...)` or, by default, the cache from before the write.
    record: the layer's recorded inputs (None before the write): `(q, k, v,
      positions)` of `update_attend` (`[B, T, N, H]`, `[B, T, K, H]` x 2, `i32[B, T]`,
      before RoPE) or the `update` arguments of an MLA layer.
    journal_kind: static, `COPY` or `KIND`.
    call: static, "update_attend" or "update" (which call `record` holds).
    options: static, the recorded call's keyword options as sorted `(name, value)`.
  """

  cache: Any
  journal: Any = None
  record: Any = None
  journal_kind: str = struct.field(pytree_node=False, default=COPY)
  call: str = struct.field(pytree_node=False, default="")
  options: tuple = struct.field(pytree_node=False, default=())

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in Draft.__dataclass_fields__:
      raise AttributeError(name)
    return getattr(self.cache, name)

  # -- the writes the modules make (through `protocol.update_attend` / `protocol.write`) ----

  def _journal(self, new_lengths: jax.Array, num_tokens: int) -> tuple[Any, str]:
    if self.record is not None:
      raise ValueError("a Draft takes one write (one forward pass); commit it and begin a new "
                       "transaction for the next")
    journal = getattr(self.cache, "draft_journal", None)
    if journal is not None:
      return journal(new_lengths, num_tokens), KIND
    return self.cache, COPY

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, **options) -> tuple[jax.Array, "Draft"]:
    """`protocol.update_attend` for the wrapped cache, journaled and recorded."""
    journal, journal_kind = self._journal(new_lengths, k.shape[1])
    options = dict(options, rope_theta=rope_theta, rope_scaling=rope_scaling)
    out, cache = _update_attend(self.cache, q, k, v, positions, new_lengths, options)
    return out, Draft(cache=cache, journal=journal, record=(q, k, v, positions),
                      journal_kind=journal_kind, call="update_attend",
                      options=_static(options))

  def update_unchecked(self, *new: jax.Array) -> "Draft":
    """`protocol.write` for the wrapped cache (`update(*new, new_lengths)`), journaled and
    recorded."""
    *new, new_lengths = new
    journal, journal_kind = self._journal(new_lengths, new[0].shape[1])
    cache = protocol.write(self.cache, *new, new_lengths=new_lengths)
    return Draft(cache=cache, journal=journal, record=tuple(new), journal_kind=journal_kind,
                 call="update")

  def update(self, *new: jax.Array, new_lengths: jax.Array | None = None) -> "Draft":
    """The protocol's `update`: as `update_unchecked`, `new_lengths` default T."""
    return self.update_unchecked(*new, protocol._all_tokens(new[0], new_lengths))  # pylint: disable=protected-access

  def attend(self, *args, **kwargs) -> jax.Array:
    """The wrapped cache's `attend`."""
    return self.cache.attend(*args, **kwargs)


def _static(options: dict[str, Any]) -> tuple:
  """Options as a hashable sorted tuple (a sequence of backend names becomes a tuple)."""
  return tuple(sorted((name, tuple(v) if isinstance(v, list) else v)
                      for name, v in options.items()))


def _update_attend(cache, q, k, v, positions, new_lengths, options):
  """`protocol.update_attend` as a chunk when the kind allows it, else stepwise."""
  if q.shape[1] == 1 or chunk_equals_steps(cache):
    return protocol.update_attend(cache, q, k, v, positions=positions, new_lengths=new_lengths,
                                  **options)
  return stepwise_update_attend(cache, q, k, v, positions=positions, new_lengths=new_lengths,
                                **options)


def stepwise_update_attend(cache, q, k, v, *, positions, new_lengths, **options):
  """`protocol.update_attend` of a chunk as T one-token steps (`lax.scan`): token t of row
  b is written (and attends) after tokens `< t`, exactly as in token-by-token decoding.
  `q: [B, T, N, H]`, `k, v: [B, T, K, H]` (before RoPE), `positions: i32[B, T]`,
  `new_lengths: i32[B]`; returns `(out [B, T, N, H], cache)`."""
  num_tokens = q.shape[1]

  def step(c, xs):
    t, qt, kt, vt, pt = xs
    out, c = protocol.update_attend(c, qt[:, None], kt[:, None], vt[:, None],
                                    positions=pt[:, None],
                                    new_lengths=(t < new_lengths).astype(jnp.int32), **options)
    return c, out[:, 0]

  first = lambda x: jnp.moveaxis(x, 1, 0)
  xs = (jnp.arange(num_tokens, dtype=jnp.int32), first(q), first(k), first(v), first(positions))
  cache, out = jax.lax.scan(step, cache, xs)
  return jnp.moveaxis(out, 0, 1), cache


# ----------------------------------------------------------------------------------------------
# The transaction.


def begin(cache: Any) -> Draft:
  """Opens a transaction on one layer's cache: pass the result to the layer in its place."""
  if isinstance(cache, Draft):
    raise ValueError("cache is already inside a transaction (a Draft); commit it first")
  return Draft(cache=cache)


def commit(draft: Draft, keep: jax.Array) -> Any:
  """The cache holding, of the T tokens written through `draft`, only the first `keep[b]` of row b
  (`i32[B]`, in `[0, new_lengths[b]]` of the write): equal to the cache of a run that wrote only
  those (module doc). A draft nothing was written through returns its cache."""
  if not isinstance(draft, Draft):
    raise TypeError(f"draft must be a transaction.Draft (from begin); got "
                    f"{type(draft).__name__}")
  cache = draft.cache
  if draft.record is None:
    return cache
  keep = jnp.asarray(keep, jnp.int32)
  if draft.journal_kind == KIND:
    cheap = getattr(cache, "commit_draft", None)
    if cheap is not None:
      return cheap(draft.journal, keep)
    before = cache.undo_draft(draft.journal)
  else:
    before = draft.journal
  return replay(before, draft, keep)


def replay(before: Any, draft: Draft, keep: jax.Array) -> Any:
  """`before` (the cache from before the draft) after the draft's recorded call with
  `new_lengths = keep`: what a run that never saw the rejected tokens writes."""
  if draft.call == "update":
    return protocol.write(before, *draft.record, new_lengths=keep)
  q, k, v, positions = draft.record
  _, cache = _update_attend(before, q, k, v, positions, keep, dict(draft.options))
  return cache


def begin_all(caches: Any) -> tuple[Draft, ...]:
  """`begin` on every layer's cache."""
  return tuple(begin(c) for c in caches)


def commit_all(drafts: Any, keep: jax.Array) -> tuple[Any, ...]:
  """`commit` on every layer's draft with the same `keep`."""
  return tuple(commit(d, keep) for d in drafts)
