"""Tests for kvattn.training.trainer: loss drops on the default corpus, exact checkpoint resume, metrics."""

from __future__ import annotations

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn.training import data

from kvattn.training import trainer as train

from kvattn.models import transformer

TINY = dict(d_model=32, num_layers=2, mlp_dim=64,
            attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))


def tiny_config(**train_overrides):
  cfg = train.default_config(**TINY)
  cfg.data.max_bytes = 2**20
  cfg.data.seq_len = 64
  cfg.train.update(dict(steps=40, batch_size=8, warmup_steps=4, log_every=5, eval_batches=4,
                        progress=False))
  cfg.train.update(train_overrides)
  return cfg


def test_loss_drops_clearly_on_the_default_corpus():
  result = train.train_and_evaluate(tiny_config())
  losses = [h["loss"] for h in result.history if "loss" in h]
  assert len(losses) == 8
  first = losses[0]  # the loss at step 5, near ln(259) = 5.56 (uniform over the vocabulary)
  assert first > 5.0
  # After 40 steps the byte-level model has learned the byte statistics of source text
  # (measured: ~5.4 -> ~3.8 nats, validation ~3.8).
  assert result.metrics["train_loss"] < first - 1.2
  assert losses[-1] < 4.0
  assert result.metrics["validation_loss"] < 4.2
  assert math.isclose(result.metrics["validation_bits_per_byte"],
                      result.metrics["validation_loss"] / math.log(2), rel_tol=0.05)
  assert result.metrics["steps"] == 40


def small_trainer(seed=0):
  cfg = tiny_config()
  model = transformer.Transformer.from_config(cfg.model, rngs=nnx.Rngs(seed))
  return train.Trainer(model, cfg.train)


def batches(n, seed=0):
  rows = data.pack([data.Document(str(i), (f"def f{i}(x):\n  return x * {i}\n" * 6).encode())
                    for i in range(40)], seq_len=32)
  it = data.BatchIterator(rows, 4, seed=seed)
  return it, [next(it) for _ in range(n)]


def test_checkpoint_restore_gives_identical_params_and_next_step_loss(tmp_path):
  trainer = small_trainer(seed=0)
  it = data.BatchIterator(batches(0)[0].rows, 4, seed=3)
  for _ in range(3):
    trainer.train_step(next(it))
  manager = train.checkpoint_manager(str(tmp_path / "ckpt"))
  trainer.save(manager, {"data": it.state()})
  saved = jax.tree.map(np.asarray, trainer.params)
  step_after = trainer.train_step(next(it))
  params_after = jax.tree.map(np.asarray, trainer.params)

  fresh = small_trainer(seed=1)  # different init: everything must come from the checkpoint
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh.params),
                                                       jax.tree.leaves(saved)))
  extra = fresh.restore(train.checkpoint_manager(str(tmp_path / "ckpt")))
  assert fresh.step == 3
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.params), saved)
  it2 = data.BatchIterator(it.rows, 4, seed=3)
  it2.restore(extra["data"])
  step_again = fresh.train_step(next(it2))
  assert step_again["loss"] == step_after["loss"]  # exactly: same params, moments, step, batch
  assert step_again["learning_rate"] == step_after["learning_rate"]
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.params), params_after)


def test_train_and_evaluate_resumes_exactly_from_the_workdir(tmp_path):
  cfg = tiny_config(steps=6, checkpoint_every=3, log_every=1, eval_batches=2)
  cfg.data.seq_len = 32
  straight = train.train_and_evaluate(cfg, str(tmp_path / "a"))
  # Same run, "interrupted" after step 3: drop the step-6 checkpoint and rerun.
  train.train_and_evaluate(cfg, str(tmp_path / "b"))
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "6")
  resumed = train.train_and_evaluate(cfg, str(tmp_path / "b"))
  assert [h["step"] for h in resumed.history if "loss" in h] == [4, 5, 6]
  assert resumed.metrics["validation_loss"] == straight.metrics["validation_loss"]
  for a, b in zip(jax.tree.leaves(nnx.state(resumed.model)),
                  jax.tree.leaves(nnx.state(straight.model))):
    np.testing.assert_array_equal(a, b)


def test_evaluate_masks_padding_and_reports_bits_per_byte():
  trainer = small_trainer()
  _, (batch,) = batches(1)
  padded = batch.copy()
  padded[:, 20:] = data.PAD_ID
  full = trainer.evaluate([batch])
  part = trainer.evaluate([padded])
  assert part["tokens"] == 4 * 19  # targets 1..19 of each row; PAD targets are masked
  # All targets here are bytes or BOS/EOS; bits per byte = nats / ln 2 / byte targets.
  nll, mask, is_byte = jax.jit(train.token_losses)(trainer.model, jnp.asarray(batch))
  expected_bpb = float(nll.sum()) / math.log(2) / float(is_byte.sum())
  assert full["bits_per_byte"] == pytest.approx(expected_bpb, rel=1e-5)
  assert full["loss"] == pytest.approx(float(nll.sum() / mask.sum()), rel=1e-5)
  assert trainer.loss(batch) == pytest.approx(full["loss"], rel=1e-5)
  assert 5.0 < full["loss"] < 6.0  # untrained: close to ln(259) = 5.56


@pytest.mark.parametrize("key,value,message", [
    ("steps", 0, r"train\.steps must be a positive int"),
    ("warmup_steps", 40, r"train\.warmup_steps must be less than train\.steps"),
    ("learning_rate", -1.0, r"train\.learning_rate must be a positive"),
    ("b2", 1.0, r"train\.b2 must lie in \[0, 1\)"),
])
def test_bad_train_config_names_the_key(key, value, message):
  cfg = tiny_config()
  cfg.train[key] = value
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(cfg)
  with pytest.raises(ValueError, match=r"train\.lr is not a known key"):
    train.train_config(lr=1.0)
  with pytest.raises(ValueError, match=r"train\.lr is not a known key"):
    train.check_train_config({"lr": 1.0})


def test_trainer_takes_over_the_models_params_and_trainer_model_is_the_way_out():
  cfg = tiny_config()
  model = transformer.Transformer.from_config(cfg.model, rngs=nnx.Rngs(0))
  trainer = train.Trainer(model, cfg.train)
  _, (first, second) = batches(2)
  trainer.train_step(first)
  # As documented: the model passed in gave its param buffers to the trainer (donated).
  assert any(x.is_deleted() for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert "trainer.model" in train.Trainer.__doc__
  assert "donate" in train.Trainer.__doc__ and "donate" in train.Trainer.__init__.__doc__
  # trainer.model is a copy: later steps leave it intact.
  trained = trainer.model
  before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trained, nnx.Param))]
  trainer.train_step(second)
  after = jax.tree.leaves(nnx.state(trained, nnx.Param))
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, np.asarray(b))
