"""Timing of compiled JAX programs, shared by the experiment families and the benchmarks.

JAX dispatches asynchronously, so a clock read right after a call measures
the dispatch, not the work. Every timer here waits for its inputs before
starting the clock (`jax.block_until_ready`) and for its outputs before
stopping it:

  * `timed(fn, *args)`: one call; wall and process CPU seconds and the output.
  * `Timer(fn, *args)`: per-call seconds sampled in batches of back-to-back
    calls (for calls too short to time one by one); `round_robin` samples
    several timers in turn, so load from other processes hits them alike and
    ratios measured within one run stay meaningful.
  * `timed_prefill` / `timed_decode`: `kvattn.generate`'s compiled prefill and
    greedy decode loop; `decode_rounds` times that loop on several caches in
    interleaved rounds.
  * `stats(name, values)`: median, min and max under `name`, `name_min`,
    `name_max`.

Only JAX is imported at module level: the kernel benchmarks run on machines
that have JAX but not kvattn's other dependencies.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable, Sequence

import jax


def _ready(tree: Any) -> None:
  """Waits for the jax.Arrays among the leaves of `tree` (other leaves are skipped)."""
  jax.block_until_ready([x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)])


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, float, Any]:
  """Calls `fn(*args, **kwargs)` once; returns `(wall seconds, process CPU seconds, output)`.

  The clocks start once the array arguments are ready and stop once the
  output is. Process CPU seconds count all of this process's threads: the
  work done, which other processes sharing the machine do not inflate the way
  they inflate wall time.
  """
  _ready((args, kwargs))
  t0, c0 = time.perf_counter(), time.process_time()
  out = fn(*args, **kwargs)
  _ready(out)
  return time.perf_counter() - t0, time.process_time() - c0, out


class Timer:
  """Per-call wall seconds of `fn(*args)`, sampled on demand.

  `warm()` runs `warmup` untimed calls (the first compiles) and, when
  `calls <= 0`, sizes one sample at about `target_s` seconds of calls (1 to
  200 calls); `sample()` then times `calls` back-to-back calls and records
  the seconds per call.
  """

  def __init__(self, fn: Callable[..., Any], *args: Any, calls: int = 1, warmup: int = 1,
               target_s: float = 0.05):
    self.fn, self.args, self.calls, self.warmup, self.target_s = fn, args, calls, warmup, target_s
    self.samples: list[float] = []

  def warm(self) -> Any:
    """Runs the untimed calls; returns the last output."""
    out = None
    for _ in range(max(1, self.warmup)):
      out = jax.block_until_ready(self.fn(*self.args))
    if self.calls <= 0:
      seconds, _, _ = timed(self.fn, *self.args)
      self.calls = max(1, min(200, int(self.target_s / max(seconds, 1e-6))))
    return out

  def sample(self) -> float:
    """Times one batch of `calls` calls; records and returns the seconds per call."""
    _ready(self.args)
    start = time.perf_counter()
    out = None
    for _ in range(self.calls):
      out = self.fn(*self.args)
    jax.block_until_ready(out)
    self.samples.append((time.perf_counter() - start) / self.calls)
    return self.samples[-1]

  def median(self) -> float:
    """Median seconds per call over the samples taken so far."""
    return statistics.median(self.samples)


def round_robin(timers: Iterable[Timer], repeats: int) -> None:
  """Takes `repeats` samples of every timer, one of each in turn."""
  timers = list(timers)
  for _ in range(repeats):
    for timer in timers:
      timer.sample()


def read_bandwidth(nbytes: int, repeats: int = 3) -> float:
  """Bytes/s of the best of `repeats` jitted `jnp.sum` over an f32 array of `nbytes`.

  A reduction reads every byte once and writes nothing, so it is the read rate
  a decode step (which streams weights and cache) can reach at best.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jnp.ones((max(1, nbytes // 4),), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return x.nbytes / best


def stats(name: str, values: Sequence[float]) -> dict[str, float]:
  """`{name: median, name_min: min, name_max: max}` of `values`."""
  return {name: statistics.median(values), f"{name}_min": min(values),
          f"{name}_max": max(values)}


def timed_prefill(model: Any, prompts: jax.Array, lengths: jax.Array, caches: Any
                  ) -> tuple[float, jax.Array, Any, jax.Array]:
  """Runs `kvattn.generate`'s compiled greedy prefill on `caches`, which it donates.

  Args:
    model: a `kvattn.Transformer`.
    prompts: `i32[B, P]` prompt tokens (right-padded).
    lengths: `i32[B]` prompt lengths.
    caches: the model's empty caches.

  Returns:
    `(wall seconds, first tokens i32[B], prefilled caches, rng key)`.
  """
  from kvattn.inference.generation import Sampling, prefill  # pylint: disable=g-import-not-at-top
  seconds, _, (first, caches, key) = timed(prefill, model, prompts, lengths, caches,
                                           sampling=Sampling())
  return seconds, first, caches, key


def timed_decode(model: Any, first: jax.Array, caches: Any, new_tokens: int, key: jax.Array
                 ) -> tuple[float, float, jax.Array, jax.Array, Any]:
  """Runs `kvattn.generate`'s compiled greedy decode loop on `caches`, which it donates
  (pass a copy to decode the same prefilled caches again).

  Returns:
    `(wall seconds, process CPU seconds, tokens i32[B, new_tokens], lengths
    i32[B], caches)`.
  """
  from kvattn.inference.generation import Sampling, decode  # pylint: disable=g-import-not-at-top
  seconds, cpu, (tokens, lengths, caches) = timed(decode, model, first, caches, new_tokens,
                                                  sampling=Sampling(), rng=key)
  return seconds, cpu, tokens, lengths, caches


def decode_rounds(runs: dict[str, tuple[Any, jax.Array, Any]], steps: int, repeats: int
                  ) -> dict[str, dict[str, list[float]]]:
  """Greedy decode steps of several (model, caches) pairs through `kvattn.generate`'s compiled
  decode loop (caches donated), timed in `repeats` interleaved rounds of `steps` steps.

  Args:
    runs: name -> `(model, first tokens i32[B], prefilled caches)`; each caches must have room
      for `(repeats + 1) * steps` more tokens per row. The caches are donated.
    steps: model steps per timed call (one call of the loop, `steps + 1` tokens returned).
    repeats: timed rounds; the first untimed round compiles. The order of the runs rotates
      every round, so load from other processes hits them alike.

  Returns:
    name -> `{"wall": [seconds per step, one per round], "cpu": [process CPU seconds per
    step], "tokens": i32[B, (repeats + 1) * steps + 1] (the first tokens, then every token
    decoded: the greedy continuation)}`.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from kvattn.inference.generation import Sampling, decode  # pylint: disable=g-import-not-at-top
  state, decoded = {}, {}
  for name, (model, first, caches) in runs.items():  # the untimed first call compiles
    tokens, _, caches = decode(model, first, caches, steps + 1, sampling=Sampling())
    state[name], decoded[name] = (model, tokens[:, -1], caches), [tokens]
  names = list(state)
  out: dict[str, dict[str, Any]] = {n: {"wall": [], "cpu": []} for n in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      model, first, caches = state[name]
      wall, cpu, (tokens, _, caches) = timed(decode, model, first, caches, steps + 1,
                                             sampling=Sampling())
      out[name]["wall"].append(wall / steps)
      out[name]["cpu"].append(cpu / steps)
      state[name] = (model, tokens[:, -1], caches)
      decoded[name].append(tokens[:, 1:])
  for name in names:
    out[name]["tokens"] = jnp.concatenate(decoded[name], axis=1)
  return out
