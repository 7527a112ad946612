"""Disaggregated prefill and decode: a prefill worker computes a prompt's KV pages, a decode
worker pulls them over JAX's transfer server and goes on decoding (the split of Splitwise,
Patel et al., ISCA 2024, and DistServe, Zhong et al., OSDI 2024).

The two workers are separate JAX runtimes (no shared `jax.distributed` mesh). Pages move with
`jax.experimental.transfer` (the prefill worker's `TransferServer.await_pull`, the decode
worker's `TransferConnection.pull`); the handshake -- the server address, a uuid per transfer,
the first token, the array specs -- goes through files in a directory both workers see
(`Rendezvous`: a JSON file written then renamed into place, so a reader sees all of it or
nothing). No socket protocol of kvattn's own.

What moves (`SequencePages`): for one row of a paged cache per layer, every pool of
`POOL_FIELDS` at the pages that row's stored tokens occupy, `[K, n, ...]`, and every per-row
array but the block table (`lengths`; KIVI's residual rings `k_res`, `v_res`), `[1, ...]`. All
of them travel as unsigned ints of their width (bit-exact: no float op quiets a NaN), and the
decode worker writes the pages into pages of its own pool through its own block table.
Covered kinds: `PagedKVCache` (f32, bf16, int8 with its scale pools) and `PagedKIVICache`
(`paged_kivi2`, `paged_kivi4`, with the residual snapshot).

Faults. The offer carries a checksum of every array (`checksums`: the CRC-32 of its bytes,
computed by the prefill worker before the arrays become pullable); the decode worker recomputes
it after the pull and before anything is installed. Every failure of a pull
raises a `TransferError` and leaves the decode worker's caches as they were, so the caller can
prefill the prompt itself (`pull_or_prefill`):
- `ChecksumError`: pulled bits that differ from the offered ones;
- `TransferTimeout` (also a `TimeoutError`): a pull not complete within its timeout -- a
  prefill worker that died before the pull connected (the transfer server retries a refused
  connection forever: the pull would hang without this bound), or one that never answers;
- `TransferError`: a pull the transfer server failed, e.g. the prefill worker's connection
  closed mid-transfer (a killed process).
`Rendezvous.wait_offer` raises TimeoutError when no offer comes.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import time
import zlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvattn.inference import generation
from kvattn.paging.allocator import pages_for

_BLOCK_TABLE = "block_tables"


class TransferError(RuntimeError):
  """A pull of a sequence's pages failed; the decode worker's caches are unchanged, so it can
  prefill the prompt itself (`pull_or_prefill`)."""


class ChecksumError(TransferError, ValueError):
  """Pulled arrays whose checksums differ from the offer's (bits changed on the way)."""


class TransferTimeout(TransferError, TimeoutError):
  """A pull not complete within its timeout (the prefill worker gone, or not answering)."""


# ----------------------------------------------------------------------------------------------
# One row of a paged cache, as bits.


def _uint(dtype) -> Any:
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def _as_bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, _uint(x.dtype))


def _row_fields(cache) -> list[str]:
  """The per-row array fields of a paged cache (leading axis B), block table excluded."""
  pools = set(cache.POOL_FIELDS)
  return [f.name for f in dataclasses.fields(cache)
          if isinstance(getattr(cache, f.name), jax.Array) and f.name not in pools
          and f.name != _BLOCK_TABLE]


def _pool_fields(cache) -> list[str]:
  return [n for n in cache.POOL_FIELDS if getattr(cache, n) is not None]


def _check_paged(caches: Sequence[Any]) -> None:
  for i, c in enumerate(caches):
    if not getattr(c, "POOL_FIELDS", ()) or not hasattr(c, _BLOCK_TABLE):
      raise TypeError(f"caches[{i}] must be a paged cache (PagedKVCache, PagedKIVICache); got "
                      f"{type(c).__name__}")


def stored_pages(cache, slot: int) -> int:
  """Pages row `slot` of `cache` fills (host int, at least 1): `ceil(t / page_size)` for the
  t tokens its pool holds (`lengths`; KIVI: its quantized store, `num_quantized`)."""
  tokens = cache.num_quantized if hasattr(cache, "num_quantized") else cache.lengths
  return max(1, pages_for(int(np.asarray(tokens)[slot]), cache.page_size))


def _row_pages(cache, slot: int, num_pages: int) -> np.ndarray:
  row = np.asarray(cache.block_tables)[slot, :num_pages]
  bad = np.flatnonzero((row < 0) | (row >= cache.num_pages))
  if len(row) < num_pages or bad.size:
    j = int(bad[0]) if bad.size else len(row)
    raise ValueError(f"block_tables[{slot}, {j}] must be a page in [0, {cache.num_pages}) (row "
                     f"{slot} holds {num_pages} pages of tokens); got "
                     f"{int(row[j]) if j < len(row) else 'nothing'}")
  return row.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SequencePages:
  """One sequence's share of every layer's paged cache, as bits.

  Attributes:
    pools: per layer, `{field: u[K, n, ...]}` the pools at the row's n filled pages, in logical
      order, as unsigned ints of the field's width.
    rows: per layer, `{field: u[1, ...]}` the row's other arrays (`lengths`, KIVI's rings).
  """

  pools: tuple[dict[str, jax.Array], ...]
  rows: tuple[dict[str, jax.Array], ...]

  def arrays(self) -> list[jax.Array]:
    """Every array, in a fixed order (what the transfer server moves)."""
    return jax.tree.leaves((self.pools, self.rows))

  @property
  def nbytes(self) -> int:
    """Bytes of all the arrays (what a transfer moves)."""
    return sum(int(a.size) * a.dtype.itemsize for a in self.arrays())

  def specs(self) -> list[tuple[list[int], str]]:
    """`[(shape, dtype name)]` of `arrays()`, JSON-able (the offer's)."""
    return [(list(a.shape), str(a.dtype)) for a in self.arrays()]


@functools.partial(jax.jit, static_argnames=("slot",))
def _gather(caches, pages, *, slot):
  pools = tuple({n: _as_bits(getattr(c, n))[:, pages] for n in _pool_fields(c)} for c in caches)
  rows = tuple({n: _as_bits(getattr(c, n))[slot:slot + 1] for n in _row_fields(c)}
               for c in caches)
  return pools, rows


def gather_sequence(caches: Sequence[Any], slot: int = 0) -> SequencePages:
  """Row `slot`'s pages and per-row arrays of every layer's paged cache.

  Args:
    caches: per-layer paged caches sharing one block table (`PagedKVCache`,
      `PagedKIVICache`), concrete.
    slot: the row, an int in `[0, B)`.

  Returns:
    A `SequencePages` of `stored_pages(caches[0], slot)` pages per pool.

  Raises:
    TypeError: a cache that is not paged.
    ValueError: a `slot` outside `[0, B)`, or a filled logical page left unassigned.
  """
  caches = tuple(caches)
  _check_paged(caches)
  batch = caches[0].block_tables.shape[0]
  if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < batch:
    raise ValueError(f"slot must be an int in [0, {batch}); got {slot!r}")
  pages = _row_pages(caches[0], int(slot), stored_pages(caches[0], int(slot)))
  pools, rows = _gather(caches, jnp.asarray(pages), slot=int(slot))
  return SequencePages(pools, rows)


@functools.partial(jax.jit, static_argnames=("slot",), donate_argnums=(0,))
def _install(caches, pages, pools, rows, *, slot):
  out = []
  for c, pool_bits, row_bits in zip(caches, pools, rows):
    fields = {}
    for n, new in pool_bits.items():
      old = getattr(c, n)
      fields[n] = jax.lax.bitcast_convert_type(_as_bits(old).at[:, pages].set(new), old.dtype)
    for n, new in row_bits.items():
      old = getattr(c, n)
      fields[n] = jax.lax.bitcast_convert_type(_as_bits(old).at[slot:slot + 1].set(new),
                                               old.dtype)
    out.append(c.replace(**fields))
  return tuple(out)


def checksums(seq: "SequencePages") -> list[int]:
  """Per array of `seq.arrays()`, the CRC-32 (`zlib.crc32`) of its bytes on the host, in
  [0, 2^32): what an offer carries and a pull verifies. On the CPU backend the host bytes are
  the array's own buffer (no copy); on an accelerator this copies each array to the host."""
  return [zlib.crc32(np.ascontiguousarray(np.asarray(a)).view(np.uint8)) for a in seq.arrays()]


def _array_names(seq: "SequencePages") -> list[str]:
  paths = jax.tree_util.tree_flatten_with_path((seq.pools, seq.rows))[0]
  return [("pools" if p[0].idx == 0 else "rows") + f"[{p[1].idx}][{p[2].key!r}]"
          for p, _ in paths]


def verify_checksums(seq: "SequencePages", want: Sequence[int]) -> None:
  """Raises `ChecksumError` naming the first array of `seq` whose checksum is not `want`'s
  (an offer's `checksums`), or when their counts differ."""
  got = checksums(seq)
  want = [int(w) for w in want]
  if len(got) != len(want):
    raise ChecksumError(f"the offer must carry one checksum per array ({len(got)}); got "
                        f"{len(want)}")
  for name, g, w in zip(_array_names(seq), got, want):
    if g != w:
      raise ChecksumError(f"pulled array {name} has checksum {g}, the offer says {w}: its "
                          f"bits changed on the way; prefill the prompt instead")


def _expected_specs(caches, num_pages: int) -> list[tuple[list[int], str]]:
  like = jax.eval_shape(lambda c: _gather(c, jnp.zeros((num_pages,), jnp.int32), slot=0),
                        tuple(caches))
  return [(list(a.shape), str(a.dtype)) for a in jax.tree.leaves(like)]


def install_sequence(caches: Sequence[Any], seq: SequencePages, slot: int = 0
                     ) -> tuple[Any, ...]:
  """`caches` with `seq` written into row `slot`: its pages into the pool pages the row's own
  block table names (`block_tables[slot, :n]`), its per-row arrays into the row. The block
  table itself is kept. `caches` are donated.

  Args:
    caches: per-layer paged caches of the kinds, head layout and page size `seq` came from;
      row `slot` must have its first n logical pages assigned.
    seq: a `SequencePages` of n pages (`gather_sequence`, or pulled by `pull_sequence`).
    slot: the row, an int in `[0, B)`.

  Raises:
    TypeError: a cache that is not paged.
    ValueError: a `slot` outside `[0, B)`, arrays whose shapes or dtypes do not match these
      caches, or a logical page of the row left unassigned.
  """
  caches = tuple(caches)
  _check_paged(caches)
  batch = caches[0].block_tables.shape[0]
  if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < batch:
    raise ValueError(f"slot must be an int in [0, {batch}); got {slot!r}")
  if len(seq.pools) != len(caches):
    raise ValueError(f"seq must hold one entry per cache ({len(caches)} layers); got "
                     f"{len(seq.pools)}")
  num_pages = next(iter(seq.pools[0].values())).shape[1]
  want = _expected_specs(caches, num_pages)
  if seq.specs() != want:
    raise ValueError(f"seq arrays must have the shapes and dtypes {want} of these caches; got "
                     f"{seq.specs()}")
  pages = _row_pages(caches[0], int(slot), num_pages)
  return _install(caches, jnp.asarray(pages), seq.pools, seq.rows, slot=int(slot))


def sequence_like(caches: Sequence[Any], num_pages: int, arrays: Sequence[jax.Array]
                  ) -> SequencePages:
  """The `SequencePages` of `caches`' structure holding `arrays` (in `SequencePages.arrays`
  order, e.g. as pulled)."""
  like = jax.eval_shape(lambda c: _gather(c, jnp.zeros((num_pages,), jnp.int32), slot=0),
                        tuple(caches))
  pools, rows = jax.tree.unflatten(jax.tree.structure(like), list(arrays))
  return SequencePages(pools, rows)


# ----------------------------------------------------------------------------------------------
# The handshake: files in a shared directory.


class Rendezvous:
  """Handshake files of transfers in `directory` (shared by both workers; a local or network
  file system): `<uuid>.offer.json` (the prefill worker's offer) and `<uuid>.done` (the decode
  worker's acknowledgement, after which the prefill worker may free the pages). Each is written
  under a temporary name and renamed into place (atomic on POSIX), so a reader never sees half a
  file.
  """

  def __init__(self, directory: str | os.PathLike, *, poll_s: float = 0.005):
    self.directory = os.fspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    self.poll_s = float(poll_s)

  def _path(self, uuid: int, suffix: str) -> str:
    return os.path.join(self.directory, f"{int(uuid)}.{suffix}")

  def _write(self, path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)

  def _wait(self, path: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
      if time.monotonic() > deadline:
        raise TimeoutError(f"no {what} at {path} after {timeout_s} s")
      time.sleep(self.poll_s)

  def offer(self, uuid: int, meta: dict) -> None:
    self._write(self._path(uuid, "offer.json"), json.dumps(meta))

  def wait_offer(self, uuid: int, timeout_s: float = 600.0) -> dict:
    """The offer of transfer `uuid`. Raises TimeoutError after `timeout_s` seconds."""
    path = self._path(uuid, "offer.json")
    self._wait(path, timeout_s, f"offer of transfer {uuid}")
    with open(path, encoding="utf-8") as f:
      return json.load(f)

  def done(self, uuid: int) -> None:
    self._write(self._path(uuid, "done"), "")

  def wait_done(self, uuid: int, timeout_s: float = 600.0) -> None:
    """Returns once the decode worker acknowledged `uuid`; TimeoutError after `timeout_s`."""
    self._wait(self._path(uuid, "done"), timeout_s, f"acknowledgement of transfer {uuid}")


# ----------------------------------------------------------------------------------------------
# The two workers' halves.


def start_server(device: Any = None):
  """A `jax.experimental.transfer` server on `device`'s client (default the first local
  device), listening on localhost (an ephemeral port)."""
  from jax.experimental import transfer  # pylint: disable=g-import-not-at-top
  device = jax.local_devices()[0] if device is None else device
  return transfer.start_transfer_server(device.client, "localhost:0", ["localhost:0"])


def offer_sequence(server, rendezvous: Rendezvous, uuid: int, seq: SequencePages,
                   **meta: Any) -> None:
  """Prefill worker: makes `seq` pullable once as transfer `uuid` and publishes the offer
  (server address, page count, array specs and `meta`, JSON-able: e.g. `first_token`,
  `prompt_length`) and the arrays' `checksums` (computed here, before the arrays are
  pullable). Keep `seq` alive until `rendezvous.wait_done(uuid)`."""
  sums = checksums(seq)
  server.await_pull(int(uuid), seq.arrays())
  num_pages = next(iter(seq.pools[0].values())).shape[1]
  rendezvous.offer(uuid, dict(meta, address=server.address(), uuid=int(uuid),
                              num_pages=int(num_pages), specs=seq.specs(),
                              nbytes=seq.nbytes, checksums=sums))


def _wait_ready(arrays: Sequence[jax.Array], deadline: float, poll_s: float) -> bool:
  """Whether every array is ready (or failed) before `time.monotonic()` passes `deadline`."""
  while not all(a.is_ready() for a in arrays):
    if time.monotonic() > deadline:
      return False
    time.sleep(poll_s)
  return True


def pull_sequence(server, offer: dict, caches: Sequence[Any], *, timeout_s: float = 600.0,
                  verify: bool = True, poll_s: float = 0.001) -> SequencePages:
  """Decode worker: pulls the offered sequence onto `caches`' device and checks its bits.

  Args:
    server: this worker's transfer server (`start_server`).
    offer: `Rendezvous.wait_offer`'s dict.
    caches: this worker's per-layer paged caches (only their structure and sizes are read;
      nothing is written, whatever happens).
    timeout_s: seconds the pull may take, connection included.
    verify: check the pulled arrays against the offer's `checksums` (before returning them).
    poll_s: seconds between checks of the pull's completion.

  Raises:
    ValueError: offered arrays whose shapes or dtypes do not match `caches`, or a
      non-positive `timeout_s`.
    TransferTimeout: the pull was not complete after `timeout_s` (a prefill worker gone
      before the connection, or not answering); its pending buffers are released.
    TransferError: the transfer server failed the pull (e.g. the connection closed
      mid-transfer: a prefill worker killed).
    ChecksumError: pulled bits that differ from the offered ones.
  """
  caches = tuple(caches)
  _check_paged(caches)
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be a positive number of seconds; got {timeout_s!r}")
  want = _expected_specs(caches, int(offer["num_pages"]))
  got = [(list(s), d) for s, d in offer["specs"]]
  if got != want:
    raise ValueError(f"offer specs must match these caches' {want}; got {got}")
  if verify and "checksums" not in offer:
    raise ValueError("offer must carry the arrays' checksums (offer_sequence writes them) "
                     "when verify=True")
  sharding = jax.sharding.SingleDeviceSharding(next(iter(caches[0].lengths.devices())))
  specs = [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=sharding) for s, d in want]
  where = f"transfer {offer['uuid']} from {offer['address']}"
  deadline = time.monotonic() + timeout_s
  conn = server.connect(offer["address"])
  arrays = conn.pull(int(offer["uuid"]), specs, timeout=datetime.datetime.now()
                     + datetime.timedelta(seconds=timeout_s))
  if not _wait_ready(arrays, deadline, poll_s):
    # The transfer server's own timeout does not end a pull whose peer is gone; failing the
    # connection releases the pull's pending buffers (a private hook of jax 0.10's server).
    poison = getattr(conn, "_poison_connection", None)
    if poison is not None:
      poison()
    raise TransferTimeout(f"{where} was not complete after {timeout_s} s: the prefill worker "
                          f"is gone or not answering; prefill the prompt instead")
  try:
    jax.block_until_ready(arrays)
  except jax.errors.JaxRuntimeError as e:
    raise TransferError(f"{where} failed: {e}; prefill the prompt instead") from e
  seq = sequence_like(caches, int(offer["num_pages"]), arrays)
  if verify:
    verify_checksums(seq, offer["checksums"])
  return seq


def pull_or_prefill(model, prompt: Any, caches: Sequence[Any], server,
                    rendezvous: Rendezvous, uuid: int, *, offer_timeout_s: float = 600.0,
                    pull_timeout_s: float = 600.0) -> tuple[int, tuple[Any, ...], dict]:
  """Decode worker, batch of one: the prompt's pages pulled from the prefill worker, or, when
  the offer does not come or the pull fails (`TransferError`, its subclasses), prefilled here
  -- the recompute path. Either way the caches hold the prompt and the first token is the
  one `kvattn.generate` samples first (greedy).

  Args:
    model: the decode worker's model (the prefill worker's weights).
    prompt: `i32[T]` the prompt's tokens (host).
    caches: per-layer paged caches of batch 1, empty, row 0's pages assigned; donated.
    server, rendezvous, uuid: this worker's transfer server, the handshake directory and the
      transfer's id.
    offer_timeout_s, pull_timeout_s: seconds to wait for the offer, and for the pull.

  Returns:
    `(first_token, caches, info)`: `info["source"]` is "pulled" or "prefilled", and
    `info["error"]` the failure's message when prefilled (else None). The transfer is
    acknowledged (`rendezvous.done`) whenever its offer came, pulled or not.

  Raises:
    ValueError: caches of another batch than 1, or an offer whose arrays do not fit them.
  """
  caches = tuple(caches)
  _check_paged(caches)
  if caches[0].block_tables.shape[0] != 1:
    raise ValueError(f"caches must have batch 1; got {caches[0].block_tables.shape[0]}")
  prompt = np.asarray(prompt, np.int32).reshape(1, -1)
  offer = None
  try:
    offer = rendezvous.wait_offer(uuid, timeout_s=offer_timeout_s)
    seq = pull_sequence(server, offer, caches, timeout_s=pull_timeout_s)
  except (TransferError, TimeoutError) as e:
    if offer is not None:
      rendezvous.done(uuid)  # not needed any more: a live prefill worker may free the pages
    first, caches, _ = generation.prefill(model, prompt, np.array([prompt.shape[1]]), caches)
    return int(np.asarray(first)[0]), tuple(caches), dict(source="prefilled", error=str(e))
  rendezvous.done(uuid)
  return int(offer["first_token"]), install_sequence(caches, seq, 0), dict(source="pulled",
                                                                           error=None)
