"""Tests for kvattn.training.data: byte tokenizer, corpora, split, packing, batch iterator."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvattn.training import data


def test_tokenizer_ids_and_round_trip():
  assert (data.BOS_ID, data.EOS_ID, data.PAD_ID, data.VOCAB_SIZE) == (256, 257, 258, 259)
  text = "héllo\n→ ok"
  ids = data.encode(text, bos=True, eos=True)
  assert ids.dtype == np.int32
  assert ids[0] == data.BOS_ID and ids[-1] == data.EOS_ID
  assert ids[1:-1].tolist() == list(text.encode("utf-8"))
  assert data.decode(ids) == text
  # PAD dropped, stop at EOS, invalid UTF-8 replaced instead of raising.
  assert data.decode([104, data.PAD_ID, 105, data.EOS_ID, 106]) == "hi"
  assert data.decode([104, data.EOS_ID, 106], stop_at_eos=False) == "hj"
  assert data.decode([0xFF, 104]) == "\ufffdh"
  with pytest.raises(TypeError, match="text must be str or bytes"):
    data.encode(3)


@pytest.fixture(scope="module")
def default_docs():
  return data.load_corpus(max_bytes=2**20)


def test_default_corpus_is_stdlib_sources_and_pydoc_topics(default_docs):
  names = [d.name for d in default_docs]
  total = sum(len(d.data) for d in default_docs)
  assert 2**20 <= total < 2**20 + max(len(d.data) for d in default_docs)  # the cap, crossed once
  stdlib = data.stdlib_dir()
  py = [n for n in names if n.endswith(".py")]
  assert py and all(n.startswith(stdlib) for n in py)
  assert not any(f"{os.sep}site-packages{os.sep}" in n or f"{os.sep}dist-packages{os.sep}" in n
                 for n in names)
  assert not any(f"{os.sep}test{os.sep}" in n[len(stdlib):] for n in names)
  full = data.load_corpus(max_bytes=None)
  full_names = {d.name for d in full}
  assert any(n.startswith("pydoc_data.topics:") for n in full_names)
  assert os.path.join(stdlib, "os.py") in full_names
  assert sum(len(d.data) for d in full) > 4 * 2**20  # megabytes of real text
  topic = next(d for d in full if d.name == "pydoc_data.topics:for")
  assert b"for" in topic.data
  for d in default_docs[:20]:
    d.data.decode("utf-8")  # valid text
  # Deterministic and a prefix of the uncapped order.
  again = data.load_corpus(max_bytes=2**20)
  assert [d.name for d in again] == names
  assert [d.name for d in full][:len(names)] == names


def test_corpus_from_file_dir_and_glob(tmp_path):
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "x.txt").write_text("alpha text", encoding="utf-8")
  (tmp_path / "a" / "y.md").write_text("beta", encoding="utf-8")
  (tmp_path / "b.txt").write_text("gamma ✓", encoding="utf-8")
  (tmp_path / "bin.dat").write_bytes(b"\x00\x01\xff")  # not text: skipped
  by_dir = {d.name: d.data for d in data.load_corpus(str(tmp_path))}
  assert set(by_dir) == {str(tmp_path / "a" / "x.txt"), str(tmp_path / "a" / "y.md"),
                         str(tmp_path / "b.txt")}
  assert by_dir[str(tmp_path / "b.txt")] == "gamma ✓".encode()
  by_glob = data.load_corpus(str(tmp_path / "**" / "*.txt"))
  assert sorted(d.name for d in by_glob) == [str(tmp_path / "a" / "x.txt"), str(tmp_path / "b.txt")]
  one = data.load_corpus(str(tmp_path / "b.txt"))
  assert [d.data for d in one] == ["gamma ✓".encode()]
  with pytest.raises(ValueError, match="matched none"):
    data.load_corpus(str(tmp_path / "*.nothing"))
  with pytest.raises(ValueError, match="max_bytes must be a positive int"):
    data.load_corpus(str(tmp_path), max_bytes=0)


def test_split_is_by_document_deterministic_and_disjoint(default_docs):
  train, val = data.split_documents(default_docs, 0.1)
  train2, val2 = data.split_documents(list(reversed(default_docs)), 0.1)
  assert {d.name for d in val} == {d.name for d in val2}  # independent of order
  assert {d.name for d in train} == {d.name for d in train2}
  assert not {d.name for d in train} & {d.name for d in val}
  assert len(train) + len(val) == len(default_docs)
  assert 0.03 < len(val) / len(default_docs) < 0.2
  with pytest.raises(ValueError, match="validation_fraction must lie in"):
    data.split_documents(default_docs, 1.0)
  with pytest.raises(ValueError, match="split 1 documents into"):
    data.split_documents(default_docs[:1], 0.5)


def test_pack_rows():
  docs = [data.Document("a", b"abc"), data.Document("b", b"de")]
  rows = data.pack(docs, seq_len=3)
  stream = [256, 97, 98, 99, 257, 256, 100, 101, 257]
  assert rows.shape == (3, 4) and rows.dtype == np.int32
  assert rows.reshape(-1)[:9].tolist() == stream
  assert (rows.reshape(-1)[9:] == data.PAD_ID).all()
  with pytest.raises(ValueError, match="seq_len must be a positive int"):
    data.pack(docs, 0)


def test_batch_iterator_is_seeded_covers_each_epoch_and_resumes():
  rows = np.arange(10 * 3, dtype=np.int32).reshape(10, 3)
  it = data.BatchIterator(rows, 3, seed=7)
  assert it.batches_per_epoch == 3
  epoch0 = [next(it) for _ in range(3)]
  seen = np.concatenate(epoch0)[:, 0] // 3
  assert len(set(seen.tolist())) == 9  # 9 distinct rows; the 10th waits for another epoch
  epoch1 = [next(it) for _ in range(3)]
  assert not all(np.array_equal(a, b) for a, b in zip(epoch0, epoch1))  # reshuffled
  same = data.BatchIterator(rows, 3, seed=7)
  np.testing.assert_array_equal(next(same), epoch0[0])
  other = data.BatchIterator(rows, 3, seed=8)
  assert not np.array_equal(next(other), epoch0[0])
  # Resume mid-epoch and across an epoch boundary.
  it = data.BatchIterator(rows, 3, seed=7)
  for _ in range(4):
    next(it)
  state = it.state()
  expected = [next(it) for _ in range(4)]
  resumed = data.BatchIterator(rows, 3, seed=7)
  resumed.restore(state)
  for e in expected:
    np.testing.assert_array_equal(next(resumed), e)
  with pytest.raises(ValueError, match="seed"):
    other.restore(state)
  with pytest.raises(ValueError, match="batch_size must be at most"):
    data.BatchIterator(rows, 11)


def test_eval_batches_pad_the_last_batch():
  rows = np.arange(5 * 2, dtype=np.int32).reshape(5, 2)
  batches = list(data.eval_batches(rows, 2))
  assert len(batches) == 3
  np.testing.assert_array_equal(np.concatenate(batches)[:5], rows)
  assert (batches[-1][1] == data.PAD_ID).all()
  assert len(list(data.eval_batches(rows, 2, max_batches=1))) == 1


def test_dataset_from_config():
  cfg = data.data_config(max_bytes=2**19, seq_len=32)
  ds = data.dataset_from_config(cfg)
  assert ds.train_rows.shape[1] == 33 and ds.validation_rows.shape[1] == 33
  assert ds.num_train_documents > ds.num_validation_documents > 0
  assert (ds.train_rows[0, 0] == data.BOS_ID)
  with pytest.raises(ValueError, match=r"data\.seq_lenn is not a known key"):
    data.data_config(seq_lenn=3)
  with pytest.raises(ValueError, match=r"data\.foo is not a known key"):
    data.dataset_from_config({"foo": 1})
