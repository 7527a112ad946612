"""The batcher's jitted programs. Each is traced once: shapes are static, the slot is traced
(`traces` counts the traces). Every row operation is the cache's own (`capabilities.op`):
`assign_slot`, `slot_view`, `with_slot_view`, `set_block_row`, `release_slot`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn.caches import transaction
from kvattn.caches.capabilities import op
from kvattn.inference import speculative as speculative_lib
from kvattn.inference.generation import sample_logits


def build(b) -> None:
  """Sets `b._join`, `b._step`, `b._set_row`, `b._release` (and `b._spec_step`,
  `b._draft_join` with speculation)."""
  graphdef, sampling, pad_id, traces = b._graphdef, b.sampling, b.pad_id, b.traces
  snapshots = b._snapshots
  page_size, chunked = b.page_size, b._chunked_prefill

  def prefill(model, views, prompt, prompt_len):
    """`(views, last [1, D])`: the prompt `i32[T]` (`prompt_len` real tokens) written into the
    batch-1 views, and its last token's hidden state. Chunked: a page at a time."""
    if not chunked:
      h, views = model.hidden(prompt[None], views, new_lengths=prompt_len[None])
      return views, jax.lax.dynamic_index_in_dim(h[0], prompt_len - 1, keepdims=True)

    def chunk(i, views, last):
      n = jnp.clip(prompt_len - i * page_size, 0, page_size)
      tokens = jax.lax.dynamic_slice_in_dim(prompt, i * page_size, page_size)
      h, views = model.hidden(tokens[None], views, new_lengths=n[None])
      here = jax.lax.dynamic_index_in_dim(h[0], jnp.maximum(n - 1, 0), keepdims=True)
      return views, jnp.where(prompt_len <= (i + 1) * page_size, here.astype(last.dtype), last)

    last = jnp.zeros((1, model.d_model), model.dtype)
    return jax.lax.fori_loop(0, (prompt_len + page_size - 1) // page_size,
                             lambda i, carry: chunk(i, *carry), (views, last))

  def join(state, caches, slot, row, prompt, prompt_len, rng, start, snapshot):
    # prompt: the tokens after the `start` already cached; snapshot: the boundary state at
    # `start` (prefix cache with rings or residuals), else None.
    traces["join"] += 1
    model = nnx.merge(graphdef, state)
    caches = tuple(op(c, "assign_slot")(slot, row, start) for c in caches)
    if snapshots is not None:
      caches = snapshots.restore(caches, slot, snapshot, start)
    views = tuple(op(c, "slot_view")(slot) for c in caches)
    views, last = prefill(model, views, prompt, prompt_len)
    caches = tuple(op(c, "with_slot_view")(slot, v) for c, v in zip(caches, views))
    rng, key = jax.random.split(rng)
    first = sample_logits(model.logits_from_hidden(last), key, sampling)[0]
    return caches, first, rng

  def step(state, caches, tokens, active, rng):
    traces["step"] += 1
    model = nnx.merge(graphdef, state)
    h, caches = model.hidden(tokens[:, None], caches, new_lengths=active.astype(jnp.int32))
    rng, key = jax.random.split(rng)
    nxt = sample_logits(model.logits_from_hidden(h[:, 0]), key, sampling)
    return caches, jnp.where(active, nxt, pad_id), rng

  def set_row(caches, slot, row):
    traces["set_row"] += 1
    return tuple(op(c, "set_block_row")(slot, row) for c in caches)

  def release(caches, slot):
    traces["release"] += 1
    return tuple(op(c, "release_slot")(slot) for c in caches)

  spec, draft_graphdef = b.speculative, b._draft_graphdef

  def spec_step(state, caches, history, ends, new_lengths, draft_state, draft_caches):
    """Drafts k tokens per slot, verifies `[last, drafts]` (`new_lengths[b]` of them, 0 for
    an empty slot) in one pass. Returns `(caches, greedy i32[S, k + 1], emit i32[S],
    draft_caches)`: slot b emits `greedy[b, :emit[b]]`."""
    traces["spec_step"] += 1
    model = nnx.merge(graphdef, state)
    rows = jnp.arange(history.shape[0])
    ends = jnp.maximum(ends, 1)
    active = new_lengths > 0
    if isinstance(spec, speculative_lib.PromptLookup):
      drafts = speculative_lib.prompt_lookup_drafts(history, ends, spec)  # [S, k]
    else:  # the draft caches catch up on the text and draft greedily
      drafts, draft_caches = speculative_lib._draft_model_drafts(  # pylint: disable=protected-access
          draft_graphdef, draft_state, draft_caches, history, ends, active,
          spec.num_draft_tokens)
    fed = jnp.concatenate([history[rows, ends - 1][:, None], drafts], axis=1)
    h, drafted = model.hidden(fed, transaction.begin_all(caches), new_lengths=new_lengths)
    greedy = jnp.argmax(model.logits_from_hidden(h), axis=-1).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(drafts == greedy[:, :-1], axis=1), axis=1)
    emit = jnp.minimum(accepted + 1, new_lengths).astype(jnp.int32)  # 0 when empty
    if draft_caches:  # the draft caches keep what the text confirms (rolled back by lengths)
      held = jnp.where(active, ends + jnp.minimum(emit, spec.num_draft_tokens) - 1,
                       draft_caches[0].lengths)
      draft_caches = tuple(c.replace(lengths=jnp.minimum(c.lengths, held))
                           for c in draft_caches)
    return transaction.commit_all(drafted, emit), greedy, emit, draft_caches

  def draft_join(draft_state, draft_caches, slot, prompt, prompt_len):
    """Prefills row `slot` of the draft caches with the whole prompt."""
    traces["draft_join"] += 1
    draft = nnx.merge(draft_graphdef, draft_state)
    rows = tuple(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, slot, 0), c)
                 for c in draft_caches)
    rows = tuple(c.replace(lengths=jnp.zeros_like(c.lengths)) for c in rows)
    _, rows = draft.hidden(prompt[None], rows, new_lengths=prompt_len[None])
    return tuple(jax.tree.map(lambda x, r: jax.lax.dynamic_update_index_in_dim(x, r, slot, 0),
                              c, r) for c, r in zip(draft_caches, rows))

  b._join = jax.jit(join, donate_argnums=(1,))
  b._step = jax.jit(step, donate_argnums=(1,))
  if spec is not None:
    b._spec_step = jax.jit(spec_step, donate_argnums=(1, 6))
  if draft_graphdef is not None:
    b._draft_join = jax.jit(draft_join, donate_argnums=(1,))
  b._set_row = jax.jit(set_row, donate_argnums=(0,))
  b._release = jax.jit(release, donate_argnums=(0,))
