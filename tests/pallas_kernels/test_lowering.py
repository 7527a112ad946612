"""Every kernel configuration we ship lowers for "cuda" (Triton) and "tpu" (Mosaic).

No GPU or TPU has compiled these kernels. Lowering needs no device: the
wrappers take the target as `platform=` (it picks the schedule and allows
`interpret=False` on a CPU host), and `jax.jit(f).trace(*args).lower(
lowering_platforms=(platform,))` runs Pallas' Triton or Mosaic lowering of the
kernel into the module's custom call (`__gpu$xla.gpu.triton` with jaxlib <=
0.10.2, `triton_kernel_call_ffi` after it; `tpu_custom_call`). That catches
what those lowerings reject (unsupported casts, scalar prefetch on Triton,
TPU block shapes, ...); it does not run ptxas or libtpu's Mosaic compiler,
so a config that lowers may still fail to compile on the device.

The grid: kernel (dense GQA decode, paged decode, absorbed-MLA decode) x
target x cache dtype (f32, bf16, int8 and fp8 e4m3 with per-slot f32 scales)
x head dim (64, 80, 96, 128, 256; MLA: the latent width C, plus DeepSeek-V2's
512, with R = 64) x options (plain, window, soft cap, both; MLA takes no
soft cap). A config the kernel's `unsupported_reason` accepts must lower to
one custom call of the kernel; one it refuses must be in `REFUSED` with the
reason it gives, and `REFUSED` also records whether tracing and lowering
reject it too (with which error) or only the device compiler is expected to.
The default selection lowers `FAST` (a covering subset, 42 tests, ~5 s on one
core); `pytest -m slow` lowers the whole grid (418 tests, ~45 s).
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import dense_decode, paged_decode

TARGETS = {  # lowering platform -> the custom call names its kernels lower to
    "cuda": ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi"),
    "tpu": ("tpu_custom_call",),
}
KERNEL_NAMES = {"dense": "kvattn_decode_attention", "paged": "kvattn_paged_decode_attention",
                "mla": "kvattn_decode_attention"}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8,
          "fp8": jnp.float8_e4m3fn}
HEAD_DIMS = (64, 80, 96, 128, 256)
MLA_LATENTS = HEAD_DIMS + (512,)  # C; 512 is DeepSeek-V2's kv_lora_rank
MLA_ROPE = 64  # R, DeepSeek-V2's qk_rope_head_dim
OPTIONS = {"plain": (None, None), "window": (64, None), "soft_cap": (None, 30.0),
           "window+soft_cap": (64, 30.0)}  # name -> (window, soft_cap)
# Shapes: B = 2, N = 8 query heads over K = 2 KV heads (G = 4; MLA: one latent head,
# G = 8), S = 256 slots (paged: 8 pages of 32 per sequence in a pool of 20; 32 is a
# multiple of the TPU sublane count of every dtype here).
BATCH, NUM_HEADS, NUM_KV, CAPACITY, PAGE_SIZE, NUM_PAGES = 2, 8, 2, 256, 32, 20

# Configs a kernel's `unsupported_reason` refuses, as (target, kernels, dtypes, head
# dims, reason regex, the error regex of tracing and lowering it, or None). None:
# Pallas' lowering takes the config and the refusal is for what the device compiler
# is expected to reject, untested until a GPU/TPU run lifts or confirms it.
REFUSED = [
    # Mosaic has no fp8 -> f32 conversion on the TPU generations we target.
    ("tpu", ("dense", "paged", "mla"), ("fp8",), MLA_LATENTS,
     "dtype float8_e4m3fn is not f32/bf16/int8 on TPU", None),
    # TPU lanes: dot widths must be multiples of 64 (the block spans the whole last
    # dim, so Mosaic's lowering takes 80 and 96; its compiler may not).
    ("tpu", ("dense", "paged", "mla"), ("f32", "bf16", "int8"), (80, 96),
     r"head dim H=(80|96) is not a multiple of 64 \(TPU lanes\)", None),
    # The paged "loop" kernel gathers whole pages with an index array, which the
    # masked (padded-width) load does not cover: head dims must be powers of two.
    ("cuda", ("paged",), tuple(DTYPES), (80, 96),
     r"head dim H=(80|96) is not a power of two >= 16 \(Triton dot\)",
     r"head dim H must be a power of two for the \"loop\" schedule"),
]


def _refusal(kernel, target, dtype, width):
  """`(reason regex, lowering error regex or None)` of the `REFUSED` entry covering the
  config, or None when the kernel must take it."""
  for where, kernels, dtypes, widths, reason, error in REFUSED:
    if where == target and kernel in kernels and dtype in dtypes and width in widths:
      return reason, error
  return None


def _config(kernel, target, dtype, width, option):
  """`(f, args, reason)`: the kernel's public wrapper compiled for `target` with
  this config, its abstract arguments and `unsupported_reason`'s verdict."""
  cache_dtype = jnp.dtype(DTYPES[dtype])
  # f32 caches get f32 queries; bf16 and quantized caches bf16 ones (the dots then
  # run in bf16, as a served model would).
  q_dtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
  quantized = dtype in ("int8", "fp8")
  window, soft_cap = OPTIONS[option]
  sds, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
  lengths = sds((BATCH,), i32)
  if kernel == "dense":
    k = sds((BATCH, NUM_KV, CAPACITY, width), cache_dtype)
    scale = sds(k.shape[:3], f32) if quantized else None
    reason = dense_decode.unsupported_reason((BATCH, NUM_HEADS, width), k.shape, k.shape,
                                             cache_dtype, platform=target)

    def f(q, k, v, lengths, k_scale=None, v_scale=None):
      return dense_decode.decode_attention(q, k, v, lengths, window=window, soft_cap=soft_cap,
                                           k_scale=k_scale, v_scale=v_scale, platform=target)

    args = (sds((BATCH, NUM_HEADS, width), q_dtype), k, k, lengths)
  elif kernel == "paged":
    pool = sds((NUM_KV, NUM_PAGES, PAGE_SIZE, width), cache_dtype)
    scale = sds(pool.shape[:3], f32) if quantized else None
    reason = paged_decode.unsupported_reason((BATCH, NUM_HEADS, width), pool.shape, pool.shape,
                                             cache_dtype, platform=target)

    def f(q, k_pages, v_pages, tables, lengths, k_scale=None, v_scale=None):
      return paged_decode.paged_decode_attention(
          q, k_pages, v_pages, tables, lengths, window=window, soft_cap=soft_cap,
          k_scale=k_scale, v_scale=v_scale, platform=target)

    args = (sds((BATCH, NUM_HEADS, width), q_dtype), pool, pool,
            sds((BATCH, CAPACITY // PAGE_SIZE), i32), lengths)
  else:
    assert soft_cap is None, "MLA takes no soft cap"
    c_kv = sds((BATCH, CAPACITY, width), cache_dtype)
    k_rope = sds((BATCH, CAPACITY, MLA_ROPE), cache_dtype)
    scale = sds((BATCH, CAPACITY), f32) if quantized else None
    # As kvattn's dispatch checks it: C and R each as the head dim of a 1-head cache.
    reason = (dense_decode.unsupported_reason(None, (BATCH, 1, CAPACITY, width), None,
                                              cache_dtype, platform=target)
              or dense_decode.unsupported_reason(None, (BATCH, 1, CAPACITY, MLA_ROPE), None,
                                                 cache_dtype, platform=target))

    def f(q_latent, q_rope, c_kv, k_rope, lengths, c_kv_scale=None, k_rope_scale=None):
      return dense_decode.mla_decode_attention(
          q_latent, q_rope, c_kv, k_rope, lengths, sm_scale=0.1, window=window,
          c_kv_scale=c_kv_scale, k_rope_scale=k_rope_scale, platform=target)

    args = (sds((BATCH, NUM_HEADS, width), q_dtype), sds((BATCH, NUM_HEADS, MLA_ROPE), q_dtype),
            c_kv, k_rope, lengths)
  return f, args + ((scale, scale) if quantized else ()), reason


def _lower(f, args, target) -> str:
  """The StableHLO text of `f(*args)` lowered for `target` (not compiled)."""
  return jax.jit(f).trace(*args).lower(lowering_platforms=(target,)).as_text()


def _custom_calls(text, target):
  """The custom-call lines of `text` that launch a `target` kernel."""
  names = "|".join(re.escape(name) for name in TARGETS[target])
  return [line for line in text.splitlines()
          if re.search(rf"stablehlo\.custom_call @\"?({names})\"?\(", line)]


def _grid():
  for kernel, target, dtype in itertools.product(("dense", "paged", "mla"), TARGETS, DTYPES):
    for width in MLA_LATENTS if kernel == "mla" else HEAD_DIMS:
      for option in OPTIONS:
        if kernel != "mla" or OPTIONS[option][1] is None:
          yield kernel, target, dtype, width, option


# The default selection: per kernel and target every dtype, head dim and option at
# least once (checked below), so every refusal rule is exercised too.
FAST = {(kernel, target) + case
        for kernel in ("dense", "paged") for target in TARGETS
        for case in [("f32", 64, "window"), ("bf16", 80, "soft_cap"),
                     ("int8", 96, "window+soft_cap"), ("fp8", 80, "plain"),
                     ("bf16", 256, "window+soft_cap"), ("int8", 128, "soft_cap")]}
FAST |= {("mla", target) + case for target in TARGETS
         for case in [("f32", 64, "window"), ("bf16", 80, "plain"), ("int8", 96, "window"),
                      ("fp8", 80, "plain"), ("bf16", 128, "window"), ("int8", 256, "plain"),
                      ("bf16", 512, "window"), ("fp8", 512, "window")]}
GRID = [case if case in FAST else pytest.param(*case, marks=pytest.mark.slow)
        for case in _grid()]


def test_fast_selection_covers_the_grid():
  grid = set(_grid())
  assert FAST <= grid
  for kernel, target in itertools.product(("dense", "paged", "mla"), TARGETS):
    for axis in (2, 3, 4):  # dtype, head dim, option
      assert ({case[axis] for case in FAST if case[:2] == (kernel, target)}
              == {case[axis] for case in grid if case[:2] == (kernel, target)}), (kernel, target)
  for where, kernels, dtypes, widths, *_ in REFUSED:
    assert any(case[1] == where and case[0] in kernels and case[2] in dtypes
               and case[3] in widths for case in FAST), where


@pytest.mark.parametrize("kernel, target, dtype, width, option", GRID)
def test_lowers_or_says_why_not(kernel, target, dtype, width, option):
  f, args, reason = _config(kernel, target, dtype, width, option)
  refusal = _refusal(kernel, target, dtype, width)
  if refusal is None:
    assert reason is None, f"refused without an entry in REFUSED: {reason}"
    calls = _custom_calls(_lower(f, args, target), target)
    assert len(calls) == 1, calls
    assert KERNEL_NAMES[kernel] in calls[0]
    return
  expected, error = refusal
  assert reason is not None and re.fullmatch(expected, reason), reason
  if error is None:  # the lowering takes it; the refusal is for the compiler
    assert len(_custom_calls(_lower(f, args, target), target)) == 1
  else:
    with pytest.raises(Exception, match=error):
      _lower(f, args, target)


def test_interpret_false_needs_a_device_target():
  # The host's backend is only the default target: on a CPU host a compiled call
  # without `platform=` is refused before tracing, and an unknown name is an error.
  _, args, _ = _config("dense", "cuda", "bf16", 64, "plain")
  q, k, v, lengths = (jnp.zeros(a.shape, a.dtype) for a in args)
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="interpret=False needs a GPU or TPU; the target "
                                         "platform is 'cpu'"):
      dense_decode.decode_attention(q, k, v, lengths)
  with pytest.raises(ValueError, match="platform must be one of"):
    dense_decode.decode_attention(q, k, v, lengths, platform="metal")
  with pytest.raises(ValueError, match="schedule 'grid' does not compile on cuda"):
    dense_decode.decode_attention(q, k, v, lengths, platform="cuda", schedule="grid")


# The KIVI store kernel (pallas_kernels/lowbit_decode.py): packed 2/4-bit codes with f16
# scales, bf16 queries, key groups of 32 tokens (KIVI's), value groups of 32 channels;
# S = 256 store slots. Accepted configs lower to one custom call of the kernel; head dims
# the kernel refuses give `unsupported_reason`'s reason.
KIVI_GRID = [(target, bits, width, option)
             for target in TARGETS for bits in (2, 4) for width in (64, 80, 128)
             for option in ("plain", "soft_cap")]
KIVI_FAST = {(target, bits, width, option) for target in TARGETS
             for bits, width, option in [(4, 64, "plain"), (2, 128, "soft_cap"),
                                         (4, 80, "plain")]}
KIVI_REFUSED = {"cuda": r"head dim H=80 is not a power of two >= 16 \(Triton\)",
                "tpu": r"head dim H=80 is not a multiple of 64 \(TPU lanes\)"}


@pytest.mark.parametrize("target, bits, width, option", [
    case if case in KIVI_FAST else pytest.param(*case, marks=pytest.mark.slow)
    for case in KIVI_GRID])
def test_kivi_store_kernel_lowers_or_says_why_not(target, bits, width, option):
  from pallas_kernels import lowbit_decode  # pylint: disable=g-import-not-at-top
  sds, group = jax.ShapeDtypeStruct, 32
  codes = sds((BATCH, NUM_KV, CAPACITY, width * bits // 8), jnp.uint8)
  k_scale = sds((BATCH, NUM_KV, CAPACITY // group, width), jnp.float16)
  v_scale = sds((BATCH, NUM_KV, CAPACITY, width // group), jnp.float16)
  lengths = sds((BATCH,), jnp.int32)
  reason = lowbit_decode.unsupported_reason(None, codes.shape, k_scale.shape, platform=target)
  if width == 80:
    assert reason is not None and re.fullmatch(KIVI_REFUSED[target], reason), reason
    return
  assert reason is None, reason

  def f(*args):
    return lowbit_decode.kivi_decode_attention(
        *args, bits=bits, soft_cap=30.0 if option == "soft_cap" else None, platform=target,
        return_lse=True)

  calls = _custom_calls(_lower(f, (sds((BATCH, NUM_HEADS, width), jnp.bfloat16), codes, k_scale,
                                   k_scale, codes, v_scale, v_scale, lengths, lengths), target),
                        target)
  assert len(calls) == 1 and "kvattn_kivi_decode_attention" in calls[0], calls


@pytest.mark.parametrize("target", TARGETS)
def test_paged_kivi_store_kernel_lowers(target):
  from pallas_kernels import lowbit_paged_decode  # pylint: disable=g-import-not-at-top
  sds, group, width = jax.ShapeDtypeStruct, 32, 64
  codes = sds((NUM_KV, NUM_PAGES, PAGE_SIZE, width // 2), jnp.uint8)
  k_scale = sds((NUM_KV, NUM_PAGES, PAGE_SIZE // group, width), jnp.float16)
  v_scale = sds((NUM_KV, NUM_PAGES, PAGE_SIZE, width // group), jnp.float16)
  reason = lowbit_paged_decode.unsupported_reason(codes.shape, k_scale.shape, width,
                                                  platform=target)
  assert reason is None
  assert "multiple of 64" in lowbit_paged_decode.unsupported_reason(
      codes.shape, k_scale.shape, 80, platform="tpu")

  def f(*args):
    return lowbit_paged_decode.paged_kivi_decode_attention(*args, bits=4, platform=target)

  lengths = sds((BATCH,), jnp.int32)
  calls = _custom_calls(_lower(f, (sds((BATCH, NUM_HEADS, width), jnp.bfloat16), codes, k_scale,
                                   k_scale, codes, v_scale, v_scale,
                                   sds((BATCH, CAPACITY // PAGE_SIZE), jnp.int32), lengths,
                                   lengths), target), target)
  assert len(calls) == 1 and "kvattn_paged_kivi_decode_attention" in calls[0], calls


# The rotated codebook store kernel (pallas_kernels/rotated_decode.py): packed 3/4-bit codes
# with f16 per-token scales, bf16 queries (f32 with the rotation applied around the
# kernel), S = 256 store slots and 1000 (no whole number of blocks: the "loop" schedule's
# shifted last block, the "grid" schedule's block past Sq). Accepted configs lower to one
# custom call of the kernel; head dims the kernel refuses give `unsupported_reason`'s reason.
ROTATED_GRID = [(target, bits, width, sq, option)
                for target in TARGETS for bits in (3, 4) for width in (32, 64, 128)
                for sq in (CAPACITY, 1000) for option in ("plain", "soft_cap+rotation")]
ROTATED_FAST = {(target,) + case for target in TARGETS
                for case in [(3, 64, 1000, "soft_cap+rotation"), (4, 128, CAPACITY, "plain"),
                             (4, 32, CAPACITY, "plain")]}
ROTATED_REFUSED = {"tpu": {32: r"head dim H=32 is not a multiple of 64 \(TPU lanes\)"}}


@pytest.mark.parametrize("target, bits, width, sq, option", [
    case if case in ROTATED_FAST else pytest.param(*case, marks=pytest.mark.slow)
    for case in ROTATED_GRID])
def test_rotated_store_kernel_lowers_or_says_why_not(target, bits, width, sq, option):
  from pallas_kernels import rotated_decode  # pylint: disable=g-import-not-at-top
  sds = jax.ShapeDtypeStruct
  codes = sds((BATCH, NUM_KV, sq, width * bits // 8), jnp.uint8)
  scale = sds((BATCH, NUM_KV, sq), jnp.float16)
  lengths = sds((BATCH,), jnp.int32)
  reason = rotated_decode.unsupported_reason(width, sq, platform=target)
  refused = ROTATED_REFUSED.get(target, {}).get(width)
  if refused is not None:
    assert reason is not None and re.fullmatch(refused, reason), reason
    return
  assert reason is None, reason
  rotate = option == "soft_cap+rotation"
  codebook = tuple(float(x) for x in range(1 << bits))

  def f(q, k_codes, k_scale, v_codes, v_scale, starts, lengths, rotation=None):
    return rotated_decode.rotated_decode_attention(
        q, k_codes, k_scale, v_codes, v_scale, starts, lengths, bits=bits, codebook=codebook,
        rotation=rotation, soft_cap=30.0 if rotate else None, platform=target,
        return_lse=True)

  args = (sds((BATCH, NUM_HEADS, width), jnp.float32 if rotate else jnp.bfloat16), codes,
          scale, codes, scale, lengths, lengths)
  args += (sds((NUM_KV, width, width), jnp.float32),) if rotate else ()
  calls = _custom_calls(_lower(f, args, target), target)
  assert len(calls) == 1 and "kvattn_rotated_decode_attention" in calls[0], calls
