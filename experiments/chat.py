"""Chat with a pretrained model through kvattn's caches.

    python -m experiments.chat --model smollm2-135m-instruct \\
        --prompt "What is the capital of France?"

Loads `--model` with `kvattn.checkpoints.pretrained.from_pretrained` (a registered name,
fetched and cached on first use, a `.gguf` file or a HF checkpoint directory),
renders the prompt with the checkpoint's chat template (a base model without one, such
as `--model gemma3-270m`, completes the raw prompt after a line saying so), generates with
`kvattn.generate`'s compiled prefill and decode loop (greedy unless
`--temperature` > 0; stops at the tokenizer's eos) and prints the reply, then
one line of measurements:

  load        seconds to fetch (if needed), read and build the model;
  prefill     prompt tokens / seconds of the prefill call;
  decode      generated tokens after the first / seconds of the decode loop;
  cache       the cache kind and dtype, and the bytes of every cache array
              (keys, values, scales, lengths, block tables) at the capacity
              prompt + max_new_tokens - 1.

The first run compiles both programs; with `--warmup` (default) the timed run
is a second one, so the rates exclude compilation (its time is reported too).

`--cache` picks the cache by its registry name (`kvattn.caches.registry`:
`dense`, `paged`, `ring`, `sink`, `h2o`, `snapkv`, `tova`, ..., `length_switch`),
optionally with a storage-dtype suffix `-bf16`, `-int8`, `-fp8` (float8_e4m3fn;
int8/fp8 store one f32 scale per token per head); its options come from
`--cache_option key=value` (e.g. `--cache=h2o --cache_option=budget=256`) and
`--page_size` (paged); `--import=MODULE_OR_FILE` (repeatable: a dotted name importable from the
current directory, or a .py file) first imports a module of yours that registers a kind, e.g.
`--import=my_policy.py --cache=my-policy --cache_option=budget=256`. `--weights int8` stores the weights as int8 with per-channel
scales and runs the products as int8 x int8 -> int32 (W8A8, `kvattn.models.int8`).
An eviction policy runs as kvpress's protocol with `--compress=context` and
`--compression_ratio=0.5` (or `--cache_option=budget=N`): the rendered prompt is the context,
compressed once at prefill, and the reply is appended uncompressed; the cache holds the kept
prompt tokens plus max_new_tokens - 1 (`kvattn.caches.eviction`, "compress").
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments.framework import cli
from experiments.framework import timing as timing_lib
from experiments.evals import models

from kvattn import memory
from kvattn.caches import registry as cache_factories
from kvattn.inference.generation import Sampling, decode, prefill

DTYPE_SUFFIXES = {"bf16": "bfloat16", "int8": "int8", "fp8": "float8_e4m3fn"}
"""`--cache` suffix -> storage dtype (none: the model's compute dtype)."""


def parse_cache(cache: str) -> tuple[str, str | None]:
  """`(kind, storage dtype or None)` of a `--cache` value `<kind>[-bf16|-int8|-fp8]`, the
  kind a key of `kvattn.caches.registry.CACHE_KIND_TABLE`.

  Raises:
    ValueError: an unknown kind or suffix.
  """
  kind, _, suffix = cache.rpartition("-")
  if not kind or suffix not in DTYPE_SUFFIXES:
    kind, suffix = cache, None
  if kind not in cache_factories.CACHE_KIND_TABLE:
    raise ValueError(f"cache must be one of {sorted(cache_factories.CACHE_KIND_TABLE)}, "
                     f"optionally with a suffix of {sorted(DTYPE_SUFFIXES)}; got {cache!r}")
  return kind, DTYPE_SUFFIXES.get(suffix)


def parse_options(options: Sequence[str] | None) -> dict[str, Any]:
  """`{key: int value}` of `--cache_option key=value` flags (ValueError naming a bad one)."""
  out = {}
  for item in options or ():
    key, sep, value = item.partition("=")
    try:
      out[key] = int(value)
    except ValueError:
      sep = ""
    if not sep or not key:
      raise ValueError(f"cache_option must be key=int (e.g. budget=256); got {item!r}")
  return out


flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "Registered name (kvattn.checkpoints.hub), .gguf file or HF checkpoint directory.")
flags.DEFINE_string("prompt", None, "The user's message.")
flags.DEFINE_string("system", None, "A system message (default: the template's own, if any).")
flags.DEFINE_integer("max_new_tokens", 128, "Most tokens to generate (eos stops earlier).")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples from softmax(logits / t).")
flags.DEFINE_integer("top_k", None, "Sample among the k most likely tokens.")
flags.DEFINE_float("top_p", None, "Nucleus sampling mass in (0, 1].")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_string("cache", "dense", "KV-cache kind of kvattn.caches.registry (dense, paged, "
                    "ring, sink, h2o, snapkv, ...), optionally with -bf16, -int8 or -fp8.")
flags.DEFINE_multi_string("cache_option", [], "An option of the cache kind, key=int (e.g. "
                          "budget=256, window=512); repeat for several.")
flags.DEFINE_enum("compress", None, ["fixed", "context"], "Eviction policies: 'fixed' (a budget "
                  "held forever) or 'context' (kvpress's protocol: the prompt compressed once "
                  "at prefill, the reply appended). Default: the kind's ('fixed').")
flags.DEFINE_float("compression_ratio", None, "With --compress=context: the fraction in [0, 1) "
                   "of the prompt's tokens dropped (kvpress's compression_ratio).")
flags.DEFINE_integer("page_size", 16, "Tokens per page of the paged caches.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and parameter dtype.")
flags.DEFINE_enum("weights", None, ["int8"], "Weight storage other than --dtype: int8 = W8A8 "
                  "(int8 weights with per-channel scales, int8 activations per token; "
                  "kvattn.models.int8).")
cli.define_import_flag()
flags.DEFINE_bool("warmup", True, "Run once untimed first, so the rates exclude compilation.")

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Timing:
  """One prefill + decode run: its tokens, wall seconds and process CPU seconds.

  CPU seconds (all of this process's threads) measure the work done; other
  processes sharing the machine inflate wall time but not them.
  """

  tokens: np.ndarray  # i32[B, max_new_tokens]
  lengths: np.ndarray  # i32[B] generated tokens, eos included
  prefill_s: float
  decode_s: float
  prefill_cpu_s: float
  decode_cpu_s: float
  cache_bytes: int


def cache_spec(cache: str, *, page_size: int = 16,
               options: dict[str, Any] | None = None) -> dict[str, Any]:
  """The registry spec of the `--cache` choice `cache` with `options` (ValueError naming an
  unknown choice)."""
  kind, _ = parse_cache(cache)
  spec = {"kind": kind, **(options or {})}
  if kind == "paged":
    spec.setdefault("page_size", page_size)
  return spec


def make_caches(model, cache: str, batch: int, max_len: int, *, page_size: int = 16,
                options: dict[str, Any] | None = None) -> tuple[Any, ...]:
  """Empty per-layer caches of the `--cache` choice `cache` for `batch` x `max_len` tokens,
  built through the cache registry (`model.init_caches(cache=)`) with `options`.

  Raises:
    ValueError: an unknown choice, or an option the kind rejects (naming it).
  """
  _, dtype = parse_cache(cache)
  return model.init_caches(batch, max_len, dtype,
                           cache=cache_spec(cache, page_size=page_size, options=options))


def run(model, prompts: np.ndarray, lengths: np.ndarray, max_new_tokens: int, *,
        cache: str = "dense", page_size: int = 16, options: dict[str, Any] | None = None,
        sampling=Sampling(),
        eos_id: int | None = None, seed: int = 0) -> Timing:
  """Prefill `prompts` (`i32[B, T]`, right-padded to `lengths`) then decode, timing each.

  The same two compiled programs as `kvattn.generate` (`prefill`, `decode`);
  wall and CPU seconds from `experiments.framework.timing.timed`.
  """
  batch = prompts.shape[0]
  totals = np.asarray(lengths) + max_new_tokens - 1
  # A context-compressing cache holds the kept prompt plus the reply (the prompt is its context).
  compressed = cache_factories.slots_needed(
      cache_spec(cache, page_size=page_size, options=options), np.asarray(lengths), totals)
  max_len = int(totals.max()) if compressed is None else compressed
  caches = make_caches(model, cache, batch, max_len, page_size=page_size, options=options)
  cache_bytes = memory.tree_bytes(caches)
  prompts, lengths = jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32)
  prefill_s, prefill_cpu, (first, caches, key) = timing_lib.timed(
      prefill, model, prompts, lengths, caches, sampling=sampling, rng=seed)
  decode_s, decode_cpu, (tokens, out_lengths, caches) = timing_lib.timed(
      decode, model, first, caches, max_new_tokens, sampling=sampling, eos_id=eos_id, rng=key)
  return Timing(np.asarray(tokens), np.asarray(out_lengths), prefill_s, decode_s, prefill_cpu,
                decode_cpu, cache_bytes)


def load(source: str, dtype: str, weights: str | None = None) -> tuple[Any, Any, float]:
  """`(model, tokenizer, wall seconds)` of `source` (`experiments.evals.models.load_model`:
  a registered name, a .gguf file or a HF checkpoint directory), its weights stored in
  `weights` (None: `dtype`; "int8": W8A8).

  Raises:
    app.UsageError: the checkpoint ships no tokenizer.
  """
  t0 = time.perf_counter()
  model, tok = models.load_model(source, dtype, param_dtype=weights)
  load_s = time.perf_counter() - t0
  if tok is None:
    raise app.UsageError(f"{source} ships no tokenizer; text in and out needs one")
  return model, tok, load_s


def chat_prompt(tok, prompt: str, system: str | None = None) -> str:
  """The prompt text: the chat template applied when the tokenizer has one."""
  if tok.chat_template is None:
    return prompt
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": prompt}]
  return tok.apply_chat_template(messages, add_generation_prompt=True)


def summary(load_s: float, prompt_len: int, timing: Timing, cache: str,
            compile_s: float | None) -> str:
  """The measurement line printed after the reply."""
  steps = int(timing.lengths[0]) - 1
  decode = (f"decode {steps} tok in {timing.decode_s:.3f} s = "
            f"{steps / timing.decode_s:.1f} tok/s" if steps > 0 else "decode 0 tok")
  kind, dtype = parse_cache(cache)
  parts = [f"load {load_s:.1f} s",
           f"prefill {prompt_len} tok in {timing.prefill_s:.3f} s = "
           f"{prompt_len / timing.prefill_s:.1f} tok/s", decode,
           f"cache {kind} {dtype or 'model dtype'} {timing.cache_bytes:,} bytes"]
  if compile_s is not None:
    parts.append(f"first run (compiles) {compile_s:.1f} s")
  return " | ".join(parts)


def main(argv: Sequence[str]) -> None:
  """absl entry point: prints the reply, then the measurement line."""
  if not FLAGS["verbosity"].present:
    # Only the reply and its line: absl.app shows INFO logs unless told otherwise, and JAX logs
    # its probe of absent backends at INFO ("Unable to initialize backend 'tpu'") when the
    # model loads. Warnings and errors still show; `-v 0` shows INFO again.
    logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS.prompt:
    raise app.UsageError("--prompt is required, e.g. --prompt 'What is the capital of France?'")
  if FLAGS.max_new_tokens < 1:
    raise app.UsageError(f"--max_new_tokens must be >= 1; got {FLAGS.max_new_tokens}")
  cli.import_modules(FLAGS[cli.IMPORT_FLAG].value)  # a kind it registers is a --cache choice
  with cli.config_errors():  # checked before the model loads
    parse_cache(FLAGS.cache)
    options = parse_options(FLAGS.cache_option)
    options.update({k: v for k, v in (("compress", FLAGS.compress),
                                      ("compression_ratio", FLAGS.compression_ratio))
                    if v is not None})
    cache_factories.cache_options(cache_spec(FLAGS.cache, page_size=FLAGS.page_size,
                                             options=options))
  model, tok, load_s = load(FLAGS.model, FLAGS.dtype, FLAGS.weights)
  if tok.chat_template is None:
    print(f"note: {FLAGS.model} has no chat template (a base model): completing the raw prompt")
  # A rendered chat template carries its own special tokens (transformers encodes it so too).
  ids = tok.encode(chat_prompt(tok, FLAGS.prompt, FLAGS.system),
                   add_special_tokens=tok.chat_template is None)
  prompts, lengths = np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32)
  sampling = Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)

  def once():
    return run(model, prompts, lengths, FLAGS.max_new_tokens, cache=FLAGS.cache,
               page_size=FLAGS.page_size, options=options,
               sampling=sampling, eos_id=tok.eos_id, seed=FLAGS.seed)

  compile_s = None
  if FLAGS.warmup:
    t0 = time.perf_counter()
    once()
    compile_s = time.perf_counter() - t0
  timing = once()
  reply = tok.decode(timing.tokens[0, :timing.lengths[0]], skip_special_tokens=True)
  print(reply.strip())
  print(summary(load_s, len(ids), timing, FLAGS.cache, compile_s))


if __name__ == "__main__":
  cli.run(main)
