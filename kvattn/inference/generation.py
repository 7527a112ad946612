"""Batched generation: one prefill call, then the whole decode loop in one XLA program.

`generate` checks its input on the host, then `prefill` (one jitted call over the padded
prompts, `new_lengths = prompt_lengths`, the first token sampled from each last real
position) and `decode` (one jitted `lax.while_loop` of T = 1 steps over donated caches). A
sequence that emits `eos_id` then emits `pad_id` with `new_lengths = 0`. Sampling: greedy at
temperature 0, else temperature, top-k (Fan et al. 2018) and top-p (Holtzman et al. 2020).
With `context_lengths` the prefill is two writes in one program, each prompt's context and then
the rest (kvpress's context and question; a context-compressing cache compresses the first).
Both programs are jitted on `(graphdef, state)` with shapes and sampling static; `eos_id` and
`pad_id` are traced. Any cache kind works: the loop reads only `lengths` and `capacity`.
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
from kvattn import _multihost
from kvattn import memory
from kvattn import vocab
from kvattn.caches import registry as cache_registry
from kvattn.caches.registry import CacheFactory
from kvattn.ops import quant


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Static sampling settings (hashable): `temperature` (0.0 greedy), `top_k` (None: all),
  `top_p` (None: all)."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < float("inf"):
      raise ValueError(f"temperature must be a finite float >= 0; got {t!r}")
    if t > 0 and not (float(np.finfo(np.float32).tiny) <= t <= float(np.finfo(np.float32).max)):
      # The logits are divided by the temperature in f32: inf or 0 there gives NaN/inf logits.
      raise ValueError(f"temperature must be 0 or within f32's positive range "
                       f"[{float(np.finfo(np.float32).tiny):.3g}, "
                       f"{float(np.finfo(np.float32).max):.3g}]; got {t!r}")
    _checks.optional_positive_int("top_k", self.top_k)
    p = self.top_p
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                          or not 0.0 < p <= 1.0):
      raise ValueError(f"top_p must lie in (0, 1] or be None; got {p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def sample_logits(logits: jax.Array, rng: jax.Array, sampling: Sampling) -> jax.Array:
  """Draws one token per row from `f32[B, V]` logits; returns `i32[B]`."""
  logits = logits.astype(jnp.float32)
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  vocab = logits.shape[-1]
  if sampling.top_k is not None and sampling.top_k < vocab:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]  # [B, 1]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  if sampling.top_p is not None and sampling.top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    keep = before < sampling.top_p  # always keeps the top token
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Jitted programs.


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("caches",))
def _prefill(graphdef, state, caches, prompts, prompt_lengths, rng, *, sampling):
  model = nnx.merge(graphdef, state)
  h, caches = model.hidden(prompts, caches, new_lengths=prompt_lengths)  # [B, T, D]
  rows = jnp.arange(prompts.shape[0])
  last = h[rows, prompt_lengths - 1]  # [B, D]: only the sampled positions are projected
  rng, key = jax.random.split(rng)
  first = sample_logits(model.logits_from_hidden(last), key, sampling)
  return first, caches, rng


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("caches",))
def _prefill_context(graphdef, state, caches, context, context_lengths, rest, rest_lengths, rng,
                     *, sampling):
  """Two writes: the contexts (`i32[B, Tc]`, `context_lengths`), then the rest of the prompts
  (`i32[B, Tr]`, `rest_lengths`); the first token from each prompt's last real position."""
  model = nnx.merge(graphdef, state)
  h_context, caches = model.hidden(context, caches, new_lengths=context_lengths)
  h_rest, caches = model.hidden(rest, caches, new_lengths=rest_lengths)
  rows = jnp.arange(context.shape[0])
  last = jnp.where((rest_lengths > 0)[:, None], h_rest[rows, jnp.maximum(rest_lengths - 1, 0)],
                   h_context[rows, jnp.maximum(context_lengths - 1, 0)])  # [B, D]
  rng, key = jax.random.split(rng)
  first = sample_logits(model.logits_from_hidden(last), key, sampling)
  return first, caches, rng


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "max_new_tokens"),
                   donate_argnames=("caches",))
def _decode(graphdef, state, caches, first, rng, *, sampling, max_new_tokens, eos_id, pad_id):
  # eos_id / pad_id are traced (i32 scalars): a new value does not recompile. eos_id=None is an
  # empty pytree, so "no EOS" is its own (static) program.
  batch = first.shape[0]
  tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = (first == eos_id) if eos_id is not None else jnp.zeros((batch,), bool)
  lengths = jnp.ones((batch,), jnp.int32)
  like = caches  # the stored dtypes (`quant.tree_from_bits` reads only those)

  def cond(carry):
    step, _, _, done, _, _, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    step, tokens, last, done, lengths, caches, rng = carry
    model = nnx.merge(graphdef, state)
    active = ~done
    caches = quant.tree_from_bits(caches, like)
    h, caches = model.hidden(last[:, None], caches, new_lengths=active.astype(jnp.int32))
    rng, key = jax.random.split(rng)
    nxt = sample_logits(model.logits_from_hidden(h[:, 0]), key, sampling)
    nxt = jnp.where(active, nxt, pad_id)
    tokens = jax.lax.dynamic_update_slice(tokens, nxt[:, None], (0, step))
    lengths = lengths + active.astype(jnp.int32)
    if eos_id is not None:
      done = done | (nxt == eos_id)
    return step + 1, tokens, nxt, done, lengths, quant.tree_as_bits(caches), rng

  # Narrow-float caches ride the loop as integers (`quant.as_bits`): XLA:CPU would otherwise copy
  # every layer's cache twice per step around its writes.
  carry = (jnp.int32(1), tokens, first, done, lengths, quant.tree_as_bits(caches), rng)
  _, tokens, _, _, lengths, caches, _ = jax.lax.while_loop(cond, body, carry)
  return tokens, lengths, quant.tree_from_bits(caches, like)


# ----------------------------------------------------------------------------------------------
# Public API.


def _key(rng: Any) -> jax.Array:
  """A jax key from None (key(0)), an int seed (Python or numpy, 0-d arrays too) or a key."""
  if rng is None:
    return jax.random.key(0)
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    return jax.random.key(int(rng))
  if (isinstance(rng, np.ndarray) and rng.shape == () and np.issubdtype(rng.dtype, np.integer)):
    return jax.random.key(int(rng))
  if not isinstance(rng, jax.Array):
    raise TypeError(f"rng must be a jax.random key, an int seed or None; got {type(rng).__name__}")
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return rng
  if rng.shape == (2,) and rng.dtype == jnp.uint32:
    return jax.random.wrap_key_data(rng)
  raise TypeError(f"rng must be a jax.random key; got an array {rng.dtype}{list(rng.shape)}")


def _host_float(name: str, value: Any) -> Any:
  """A Python float from a Python/numpy number or a concrete 0-d numpy/jax array
  (None and other values are passed through for `Sampling` to reject)."""
  if value is None or isinstance(value, bool):
    return value
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be concrete (generate validates on the host); got a tracer")
  if isinstance(value, (int, float, np.integer, np.floating)):
    return float(value)
  if isinstance(value, (np.ndarray, jax.Array)):
    if value.shape != () or not (np.issubdtype(value.dtype, np.floating)
                                 or np.issubdtype(value.dtype, np.integer)):
      raise TypeError(f"{name} must be a number or a 0-d numeric array; got "
                      f"{value.dtype}{list(value.shape)}")
    return float(value)
  raise TypeError(f"{name} must be a number; got {type(value).__name__}")


def _vocab_size(model) -> int:
  return int(getattr(model, "vocab_size"))


def prefill(model: nnx.Module, prompts: jax.Array, prompt_lengths: jax.Array,
            caches: Sequence[Any], *, sampling: Sampling = Sampling(), rng: Any = None,
            context_lengths: Any = None) -> tuple[jax.Array, tuple[Any, ...], jax.Array]:
  """Runs the prompts through the model into `caches` and samples the first token; unchecked
  (`generate` checks).

  Args:
    model: a `kvattn.Transformer` (anything with `hidden` / `logits_from_hidden`).
    prompts, prompt_lengths: `i32[B, T]` right-padded prompts and `i32[B]` lengths >= 1.
    caches: empty per-layer caches; donated.
    sampling, rng: settings and jax key (default key(0)).
    context_lengths: None (one write), or host `int[B]` in `[0, prompt_lengths[b]]`: the
      first `context_lengths[b]` tokens of row b are written first (its context: a
      context-compressing cache compresses this write), the rest of its prompt second, both
      in one jitted program.

  Returns:
    `(first_tokens i32[B], caches, rng)`.
  """
  graphdef, state = nnx.split(model)
  if context_lengths is None:
    return _prefill(graphdef, state, tuple(caches), jnp.asarray(prompts, jnp.int32),
                    jnp.asarray(prompt_lengths, jnp.int32), _key(rng), sampling=sampling)
  context, rest, rest_lengths = _split_prompts(np.asarray(prompts), np.asarray(prompt_lengths),
                                               np.asarray(context_lengths))
  return _prefill_context(graphdef, state, tuple(caches), jnp.asarray(context),
                          jnp.asarray(context_lengths, jnp.int32), jnp.asarray(rest),
                          jnp.asarray(rest_lengths), _key(rng), sampling=sampling)


_SPLIT_BUCKET = 64  # tokens: padding a write costs little next to a recompilation


def _split_prompts(prompts: np.ndarray, prompt_lengths: np.ndarray, context_lengths: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(context i32[B, Tc], rest i32[B, Tr], rest_lengths i32[B])`: each row's first
  `context_lengths[b]` tokens and, left-aligned, the rest of its prompt. The widths are the
  longest row's rounded up to a multiple of `_SPLIT_BUCKET` tokens (at most the prompts'
  width T, at least 1), so batches of similar prompts reuse one compiled prefill."""
  batch, width = prompts.shape
  rest_lengths = (prompt_lengths - context_lengths).astype(np.int32)
  bucket = lambda n: max(1, min(width, -(-int(n) // _SPLIT_BUCKET) * _SPLIT_BUCKET))
  context = np.zeros((batch, bucket(context_lengths.max())), np.int32)
  rest = np.zeros((batch, bucket(rest_lengths.max())), np.int32)
  for b in range(batch):
    c, n = int(context_lengths[b]), int(prompt_lengths[b])
    context[b, :c] = prompts[b, :c]
    rest[b, :n - c] = prompts[b, c:n]
  return context, rest, rest_lengths


def decode(model: nnx.Module, first_tokens: jax.Array, caches: Sequence[Any],
           max_new_tokens: int, *, sampling: Sampling = Sampling(), eos_id: int | None = None,
           pad_id: int = vocab.PAD_ID, rng: Any = None
           ) -> tuple[jax.Array, jax.Array, tuple[Any, ...]]:
  """The compiled decode loop after `prefill`: at most `max_new_tokens - 1` steps from
  `first_tokens: i32[B]` over the donated `caches`; other arguments as in `generate`.

  Returns:
    `(tokens i32[B, max_new_tokens], lengths i32[B], caches)`.
  """
  graphdef, state = nnx.split(model)
  return _decode(graphdef, state, tuple(caches), jnp.asarray(first_tokens, jnp.int32), _key(rng),
                 sampling=sampling, max_new_tokens=max_new_tokens,
                 eos_id=None if eos_id is None else np.int32(eos_id), pad_id=np.int32(pad_id))


def _host_ints(name: str, x: Any, rank: int, shape_doc: str) -> np.ndarray:
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f"{name} must be concrete (generate validates on the host); got a tracer")
  arr = np.asarray(x)
  if arr.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} {shape_doc}; got shape {arr.shape}")
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{name} must have an integer dtype; got {arr.dtype}")
  return arr


def _check_fits_memory(model, batch: int, capacity: int, max_new_tokens: int, cache_dtype: Any,
                       name: str, *, default_caches: bool) -> None:
  """Raises ValueError naming `name` if the caches (those `model.init_caches` builds, when
  generate builds them: rings for local layers) and the token buffer (`i32[B,
  max_new_tokens]`) would not fit the memory available now."""
  available = memory.available_bytes()
  if available is None:
    return
  need = 4 * batch * max_new_tokens
  per_token = getattr(model, "cache_bytes_per_token", None)
  if default_caches and per_token is not None:
    need += batch * capacity * int(per_token(cache_dtype))
    owners = cache_registry.cache_owners(model)
    dtype = getattr(model, "dtype", jnp.float32) if cache_dtype is None else cache_dtype
    for i in cache_registry.ring_layers(owners, capacity):  # a ring of W slots, not capacity
      attn = owners.layers[i].attn
      need -= batch * (capacity - attn.window) * memory.gqa_bytes_per_token(
          attn.num_kv_heads, attn.head_dim, dtype)
  if need > available:
    value = capacity if name == "max_len" else max_new_tokens
    raise ValueError(
        f"{name} = {value} needs about {need / 2**30:.2f} GiB (caches of capacity {capacity} "
        f"for {batch} sequences plus the output tokens) but only {available / 2**30:.2f} GiB "
        f"is available; use a smaller {name}")


def generate(
    model: nnx.Module,
    prompts: jax.Array,  # i32[B, T]
    prompt_lengths: jax.Array,  # i32[B]
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    rng: Any = None,
    pad_id: int = vocab.PAD_ID,
    max_len: int | None = None,
    cache_dtype: Any = None,
    caches: Sequence[Any] | None = None,
    cache_factory: CacheFactory | None = None,
    speculative: Any = None,
    context_lengths: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Generates up to `max_new_tokens` tokens per prompt (batched prefill + compiled decode).

  Args:
    model: a `kvattn.Transformer` (MHA/GQA/MQA and MLA layers alike).
    prompts: `i32[B, T]` right-padded prompts, real ids in `[0, V)`.
    prompt_lengths: `i32[B]` real tokens per prompt, in `[1, T]`.
    max_new_tokens: tokens to generate per sequence (>= 1).
    temperature: 0.0 = greedy; > 0 samples softmax(logits / temperature) (finite in f32).
    top_k: keep the k most likely tokens (None: off).
    top_p: nucleus mass in (0, 1] (None: off).
    eos_id: token that ends a sequence (None: never); traced.
    rng: jax.random key or int seed (None: key(0)).
    pad_id: token written after a sequence's EOS.
    max_len: cache capacity S in tokens; default `T + max_new_tokens - 1` (+ k drafts).
    cache_dtype: cache dtype (default the model's compute dtype).
    caches: prebuilt empty per-layer caches of batch B; donated.
    cache_factory: `(batch, max_len, dtype) -> caches` when `caches` is None; default
      `model.init_caches`, which rings the local layers of Gemma 2/3 (pass
      `lambda b, s, d: model.init_caches(b, s, d, local_layers="full")` for full length).
    speculative: None, or `PromptLookup(k)` / `DraftModel(model, k)`
      (`kvattn.inference.speculative`): greedy only, token for token plain greedy's
      output with float caches.
    context_lengths: None, or `i32[B]` in `[0, prompt_lengths[b]]`: the first
      `context_lengths[b]` tokens of prompt b are its context, written in a first call; the
      rest of the prompt (the question) in a second, then the generated tokens. A cache of
      compress="context" (`kvattn.caches.eviction`) compresses exactly the context, scored by
      the context's own queries, and appends the question and answer uncompressed: kvpress's
      protocol (its pipeline's context and question). Other kinds give the one-call result.
      None: one call (a context-compressing cache then compresses the whole prompt).
      A factory of `registry.cache_factory_from_config` (attribute `spec`) is sized to the
      kept context plus the rest (`registry.slots_needed`) when `max_len` is None.

  Returns:
    `(tokens i32[B, max_new_tokens], lengths i32[B])`; `lengths[b]` counts sequence b's
    tokens including its EOS; later positions hold `pad_id`.

  Raises:
    ValueError: prompt lengths outside `[1, T]` or past the cache, a `max_new_tokens`
      that would overflow it (a context-compressing cache: its kept context plus the rest),
      `context_lengths` of another shape or outside `[0, prompt_lengths[b]]`, ids outside `[0, V)`, bad sampling settings, caches that are
      not empty or do not match the batch, or caches and tokens that would not fit the
      memory available now (`kvattn.memory.available_bytes`).
    TypeError: non-integer prompts / lengths / context_lengths, traced inputs, a bad rng, temperature or top_p.
  """
  sampling = Sampling(_host_float("temperature", temperature),
                      top_k if not isinstance(top_k, np.integer) else int(top_k),
                      _host_float("top_p", top_p))
  max_new_tokens = _checks.positive_int("max_new_tokens", max_new_tokens)
  prompts_np = _host_ints("prompts", prompts, 2, "[B, T]")
  lengths_np = _host_ints("prompt_lengths", prompt_lengths, 1, "[B]")
  batch, width = prompts_np.shape
  if lengths_np.shape != (batch,):
    raise ValueError(f"prompt_lengths must have shape [B] = ({batch},); got {lengths_np.shape}")
  if batch == 0 or width == 0:
    raise ValueError(f"prompts must be non-empty [B, T]; got shape {prompts_np.shape}")
  if lengths_np.min() < 1:
    empty = np.nonzero(lengths_np < 1)[0].tolist()
    raise ValueError(f"prompt_lengths must be >= 1 (empty prompts cannot be continued; start "
                     f"them with BOS); got {lengths_np.tolist()}, empty: sequences {empty}")
  if lengths_np.max() > width:
    raise ValueError(f"prompt_lengths must be <= T = {width}; got {lengths_np.tolist()}")
  vocab = _vocab_size(model)
  real = np.arange(width)[None, :] < lengths_np[:, None]
  bad = real & ((prompts_np < 0) | (prompts_np >= vocab))
  if bad.any():
    b, t = map(int, np.argwhere(bad)[0])
    raise ValueError(f"prompts must hold token ids in [0, {vocab}); got {int(prompts_np[b, t])} "
                     f"at [{b}, {t}]")
  for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
      or_none = " or None" if name == "eos_id" else ""
      raise TypeError(f"{name} must be an int{or_none}; got {value!r}")
  if eos_id is not None and not 0 <= eos_id < vocab:
    raise ValueError(f"eos_id must lie in [0, {vocab}); got {eos_id}")
  eos_id = None if eos_id is None else int(eos_id)
  pad_id = int(pad_id)
  key = _key(rng)
  draft_room = 0
  if speculative is not None:
    from kvattn.inference import speculative as speculative_lib  # pylint: disable=g-import-not-at-top
    speculative = speculative_lib.check(speculative, vocab)
    if not sampling.greedy:
      raise ValueError(f"speculative decoding is greedy: temperature must be 0; got "
                       f"{sampling.temperature}")
    draft_room = speculative.num_draft_tokens  # a verify pass writes k tokens past the last

  if context_lengths is not None:
    from kvattn.caches import _context  # pylint: disable=g-import-not-at-top
    context_lengths = _context.check_context_lengths(context_lengths, lengths_np)
  totals = lengths_np.astype(np.int64) + max_new_tokens - 1 + draft_room
  contexts = lengths_np if context_lengths is None else context_lengths
  needed = int(totals.max())
  if caches is not None:
    caches = tuple(caches)
    capacities = {int(c.capacity) for c in caches}
    if len(capacities) != 1:
      raise ValueError(f"caches must share one capacity (max_len); got {sorted(capacities)}")
    capacity = capacities.pop()
    if max_len is not None and max_len != capacity:
      raise ValueError(f"max_len must match the caches' max_len {capacity}; got {max_len}")
    for i, c in enumerate(caches):
      lengths = _multihost.host_array(c.lengths)
      if lengths.shape != (batch,):
        raise ValueError(f"caches[{i}].lengths must have shape ({batch},); got {lengths.shape}")
      if lengths.any():
        raise ValueError(
            f"caches must be empty (lengths 0); caches[{i}].lengths = {lengths.tolist()}")
    compressed = [c.slots_needed(contexts, totals) if hasattr(c, "slots_needed") else None
                  for c in caches]
    if None in compressed:  # a growing cache among them needs every token
      compressed = [needed if n is None else n for n in compressed] if any(
          n is not None for n in compressed) else []
  else:
    spec = getattr(cache_factory, "spec", None)
    need = None if spec is None else cache_registry.slots_needed(spec, contexts, totals)
    compressed = [] if need is None else [need]
    capacity = (compressed[0] if compressed else width + max_new_tokens - 1 + draft_room) \
        if max_len is None else _checks.positive_int("max_len", max_len)
  if compressed:  # context-compressing caches: the kept context plus everything after it
    needed = max(compressed)
    if needed > capacity:
      raise ValueError(
          f"max_new_tokens = {max_new_tokens} would overflow the cache: the kept context + "
          f"the rest of the prompt + max_new_tokens - 1"
          + (f" + num_draft_tokens ({draft_room})" if draft_room else "")
          + f" = {needed} > max_len = {capacity} (registry.slots_needed)")
  elif lengths_np.max() > capacity:
    raise ValueError(f"prompt_lengths must fit the cache (max_len = {capacity}); the longest "
                     f"prompt has {int(lengths_np.max())} tokens")
  elif needed > capacity:
    raise ValueError(
        f"max_new_tokens = {max_new_tokens} would overflow the cache: the longest prompt "
        f"({int(lengths_np.max())}) + max_new_tokens - 1"
        + (f" + num_draft_tokens ({draft_room})" if draft_room else "")
        + f" = {needed} > max_len = {capacity}")
  if caches is None:
    _check_fits_memory(model, batch, capacity, max_new_tokens, cache_dtype,
                       "max_len" if max_len is not None else "max_new_tokens",
                       default_caches=cache_factory is None)
    factory = cache_factory or model.init_caches
    caches = tuple(factory(batch, capacity, cache_dtype))

  first, caches, key = prefill(model, prompts_np.astype(np.int32), lengths_np.astype(np.int32),
                               caches, sampling=sampling, rng=key,
                               context_lengths=context_lengths)
  if speculative is not None:
    tokens, lengths, _, _ = speculative_lib.decode(
        model, first, caches, prompts_np, lengths_np, max_new_tokens, speculative,
        eos_id=eos_id, pad_id=pad_id)
    return tokens, lengths
  tokens, lengths, _ = decode(model, first, caches, max_new_tokens, sampling=sampling,
                              eos_id=eos_id, pad_id=pad_id, rng=key)
  return tokens, lengths
