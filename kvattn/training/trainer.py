"""Training a `kvattn.Transformer` with exact checkpoint resume: next-token cross-entropy in f32
(targets != `pad_id`), global-norm clip then AdamW (Loshchilov & Hutter 2019) with warmup and
cosine decay, one jitted donating step, loss in nats per token and bits per byte, orbax
checkpoints of params, optimiser state, step and data position. Schema: `train_config`."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from absl import logging
from flax import nnx
from ml_collections import config_dict

from kvattn.training import data as data_lib
from kvattn.models import transformer as transformer_lib


def train_config(**overrides: Any) -> config_dict.ConfigDict:
  """The default `train` ConfigDict with overrides.

  Raises:
    ValueError: an override names a key that is not in the schema.
  """
  cfg = config_dict.ConfigDict()
  cfg.steps = 200  # Optimiser steps.
  cfg.batch_size = 8  # Rows (of data.seq_len tokens) per step.
  cfg.learning_rate = 3e-3  # Peak learning rate.
  cfg.warmup_steps = 20  # Linear warmup from 0.
  cfg.end_learning_rate_ratio = 0.1  # Cosine ends at learning_rate * this.
  cfg.weight_decay = 0.1  # AdamW decoupled weight decay.
  cfg.b1 = 0.9  # Adam first moment.
  cfg.b2 = 0.95  # Adam second moment.
  cfg.grad_clip_norm = 1.0  # Global gradient-norm clip.
  cfg.seed = 0  # Parameter init and data order.
  cfg.log_every = 10  # Log train metrics every N steps.
  cfg.eval_every = 0  # Evaluate every N steps (0: only at the end).
  cfg.eval_batches = 16  # Validation batches per evaluation (0: all).
  cfg.checkpoint_every = 0  # Save every N steps (0: only at the end); needs a workdir.
  cfg.progress = True  # tqdm progress bar.
  for key, value in overrides.items():
    if key not in cfg:
      raise ValueError(f"train.{key} is not a known key; expected one of {sorted(cfg.keys())}")
    setattr(cfg, key, value)
  return cfg


def _as_dict(cfg: Any) -> dict[str, Any]:
  return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


def check_train_config(cfg: Any) -> dict[str, Any]:
  """Validates a `train` section; returns it as a dict with defaults filled in.

  Raises:
    ValueError: an unknown key or a bad value, naming `train.<key>`.
  """
  d = _as_dict(cfg)
  defaults = train_config().to_dict()
  unknown = sorted(set(d) - set(defaults))
  if unknown:
    raise ValueError(f"train.{unknown[0]} is not a known key; expected one of {sorted(defaults)}")
  d = {**defaults, **d}
  for key in ("steps", "batch_size"):
    if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] <= 0:
      raise ValueError(f"train.{key} must be a positive int; got {d[key]!r}")
  for key in ("warmup_steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
              "seed"):
    if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < 0:
      raise ValueError(f"train.{key} must be a non-negative int; got {d[key]!r}")
  if d["warmup_steps"] >= d["steps"]:
    raise ValueError(
        f"train.warmup_steps must be less than train.steps = {d['steps']}; got {d['warmup_steps']}")
  for key in ("learning_rate", "grad_clip_norm"):
    if not isinstance(d[key], (int, float)) or not 0 < d[key] < math.inf:
      raise ValueError(f"train.{key} must be a positive finite float; got {d[key]!r}")
  for key in ("weight_decay", "end_learning_rate_ratio"):
    if not isinstance(d[key], (int, float)) or not 0 <= d[key] < math.inf:
      raise ValueError(f"train.{key} must be a non-negative finite float; got {d[key]!r}")
  for key in ("b1", "b2"):
    if not isinstance(d[key], (int, float)) or not 0 <= d[key] < 1:
      raise ValueError(f"train.{key} must lie in [0, 1); got {d[key]!r}")
  return d


def make_optimizer(cfg: Any) -> optax.GradientTransformation:
  """Global-norm clipping + AdamW under warmup-cosine (see the module doc)."""
  d = check_train_config(cfg)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=d["learning_rate"], warmup_steps=d["warmup_steps"],
      decay_steps=d["steps"], end_value=d["learning_rate"] * d["end_learning_rate_ratio"])
  return optax.chain(
      optax.clip_by_global_norm(d["grad_clip_norm"]),
      optax.adamw(schedule, b1=d["b1"], b2=d["b2"], weight_decay=d["weight_decay"]))


def token_losses(model: transformer_lib.Transformer, batch: jax.Array,
                 pad_id: int = data_lib.PAD_ID) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-target cross-entropy of packed rows `batch: i32[B, L + 1]` (inputs `[:, :-1]`,
  targets `[:, 1:]`): `(nll f32[B, L] in nats, mask f32[B, L] (target != pad_id), is_byte
  f32[B, L] (target < 256))`; `pad_id` -1 masks none."""
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits, _ = model(inputs)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  mask = (targets != pad_id).astype(jnp.float32)
  is_byte = (targets < data_lib.NUM_BYTES).astype(jnp.float32)
  return nll * mask, mask, is_byte * mask


def _loss(params, graphdef, rest, batch, pad_id):
  model = nnx.merge(graphdef, params, rest)
  nll, mask, _ = token_losses(model, batch, pad_id)
  return jnp.sum(nll) / jnp.maximum(jnp.sum(mask), 1.0)


def _train_step(graphdef, tx, pad_id, params, rest, opt_state, batch):
  loss, grads = jax.value_and_grad(_loss)(params, graphdef, rest, batch, pad_id)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def _eval_step(graphdef, pad_id, params, rest, batch):
  nll, mask, is_byte = token_losses(nnx.merge(graphdef, params, rest), batch, pad_id)
  return jnp.sum(nll), jnp.sum(mask), jnp.sum(is_byte)


# Jitted steps shared by every Trainer of the same model structure and optimiser settings, so
# a second Trainer (a resumed run, a sweep point repeating a variant) reuses the executables.
_STEP_CACHE: dict[Any, tuple[Any, Any]] = {}


def _compiled_steps(graphdef, config: dict[str, Any], tx, pad_id: int):
  opt_keys = ("steps", "learning_rate", "warmup_steps", "end_learning_rate_ratio",
              "weight_decay", "b1", "b2", "grad_clip_norm")
  key = (graphdef, tuple(config[k] for k in opt_keys), pad_id)
  if key not in _STEP_CACHE:
    if len(_STEP_CACHE) > 32:
      _STEP_CACHE.clear()
    _STEP_CACHE[key] = (
        jax.jit(functools.partial(_train_step, graphdef, tx, pad_id), donate_argnums=(0, 2)),
        jax.jit(functools.partial(_eval_step, graphdef, pad_id)))
  return _STEP_CACHE[key]


class Trainer:
  """Holds a model's params and optimiser state and runs jitted train / eval steps; it takes
  the model's arrays over (donated), so read the trained model from `trainer.model`."""

  def __init__(self, model: transformer_lib.Transformer, cfg: Any, *,
               trainable: Any = nnx.Param, pad_id: int = data_lib.PAD_ID):
    """Builds the optimiser and the jitted steps.

    Args:
      model: the LM; its params are taken over (donated: use `trainer.model`).
      cfg: the `train` section (`train_config()` schema).
      trainable: an `nnx` filter of the variables to train (default every `nnx.Param`;
        `ATTENTION_PARAMS`); the others get no gradients or state and are not saved.
      pad_id: targets to mask out (`token_losses`).

    Raises:
      ValueError: a bad `train` config (naming the key); a filter selecting nothing.
    """
    self.config = check_train_config(cfg)
    self.pad_id = int(pad_id)
    self.graphdef, self.params, self.rest = nnx.split(model, trainable, ...)
    if not jax.tree.leaves(self.params):
      raise ValueError(f"trainable must select at least one parameter; {trainable!r} selects none")
    self.tx = make_optimizer(self.config)
    self.opt_state = self.tx.init(self.params)
    self.step = 0
    self.schedule = optax.warmup_cosine_decay_schedule(
        0.0, self.config["learning_rate"], self.config["warmup_steps"], self.config["steps"],
        self.config["learning_rate"] * self.config["end_learning_rate_ratio"])
    self._train, self._eval = _compiled_steps(self.graphdef, self.config, self.tx, self.pad_id)

  @property
  def model(self) -> transformer_lib.Transformer:
    """The model with the current params (copies: later train steps leave it intact)."""
    params = jax.tree.map(jnp.copy, self.params)
    return nnx.merge(self.graphdef, params, self.rest)

  def train_step(self, batch: Any) -> dict[str, float]:
    """One optimiser step on `i32[B, L + 1]` rows; returns loss, grad_norm, learning_rate."""
    lr = float(self.schedule(self.step))
    self.params, self.opt_state, metrics = self._train(
        self.params, self.rest, self.opt_state, jnp.asarray(batch, jnp.int32))
    self.step += 1
    return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "learning_rate": lr}

  def loss(self, batch: Any) -> float:
    """Mean next-token loss (nats) of a batch under the current params, no update."""
    total, count, _ = self._eval(self.params, self.rest, jnp.asarray(batch, jnp.int32))
    return float(total) / max(float(count), 1.0)

  def evaluate(self, batches: Iterable[Any]) -> dict[str, float]:
    """Loss (nats/token) and bits per byte over `batches` of packed rows.

    Raises:
      ValueError: the batches hold no byte targets.
    """
    total = count = num_bytes = 0.0
    for batch in batches:
      s, c, b = self._eval(self.params, self.rest, jnp.asarray(batch, jnp.int32))
      total, count, num_bytes = total + float(s), count + float(c), num_bytes + float(b)
    if num_bytes == 0:
      raise ValueError("batches must contain byte targets to evaluate; got none")
    return {"loss": total / count, "bits_per_byte": total / math.log(2) / num_bytes,
            "tokens": count}

  def evaluate_tokens(self, batches: Iterable[Any]) -> dict[str, float]:
    """`(loss in nats per target token, perplexity, target count)` over `batches`.

    Raises:
      ValueError: the batches hold no targets.
    """
    total = count = 0.0
    for batch in batches:
      s, c, _ = self._eval(self.params, self.rest, jnp.asarray(batch, jnp.int32))
      total, count = total + float(s), count + float(c)
    if count == 0:
      raise ValueError("batches must contain targets to evaluate; got none")
    return {"loss": total / count, "perplexity": math.exp(total / count), "tokens": count}

  # -- checkpoints ------------------------------------------------------------------------------

  def save(self, manager: ocp.CheckpointManager, extra: dict[str, Any] | None = None) -> None:
    """Saves params, optimiser state, step and `extra` (JSON: e.g. the data position)."""
    manager.save(self.step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": self.params, "opt_state": self.opt_state}),
        meta=ocp.args.JsonSave({"step": self.step, "extra": extra or {}})))
    manager.wait_until_finished()

  def restore(self, manager: ocp.CheckpointManager, step: int | None = None) -> dict[str, Any]:
    """Loads the latest (or given) checkpoint into this trainer; returns its `extra`.

    Raises:
      FileNotFoundError: the manager holds no checkpoint.
    """
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    target = {"params": self.params, "opt_state": self.opt_state}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    self.params = restored["state"]["params"]
    self.opt_state = restored["state"]["opt_state"]
    self.step = int(restored["meta"]["step"])
    return restored["meta"]["extra"]


def checkpoint_manager(directory: str, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """An orbax CheckpointManager over `directory` (created; synchronous saves)."""
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=False))


@dataclasses.dataclass
class TrainResult:
  """What `train_and_evaluate` returns: the trained model, final metrics and the history."""
  model: transformer_lib.Transformer
  metrics: dict[str, float]  # final train_loss, validation_loss, validation_bits_per_byte, ...
  history: list[dict[str, float]]  # one entry per logged step / evaluation


def _validation(ev: dict[str, float]) -> dict[str, float]:
  """An evaluation's metrics as history entries (`validation_<name>`; the count left out)."""
  return {f"validation_{k}": v for k, v in ev.items() if k != "tokens"}


def _train_loop(trainer: Trainer, iterator: Any, tcfg: dict[str, Any],
                manager: ocp.CheckpointManager | None, evaluate: Any
                ) -> tuple[list[dict[str, float]], list[float], float]:
  """Steps `trainer` to `train.steps` (logging, periodic evaluation, checkpoints with the
  iterator position); returns the history, the last `log_every` losses and the seconds."""
  history, recent = [], []
  start = time.perf_counter()
  bar = tqdm.tqdm(total=tcfg["steps"], initial=trainer.step, desc="train", unit="step",
                  disable=not tcfg["progress"], leave=False)
  while trainer.step < tcfg["steps"]:
    metrics = trainer.train_step(next(iterator))
    recent = (recent + [metrics["loss"]])[-max(tcfg["log_every"], 1):]
    bar.update(1)
    bar.set_postfix(loss=f"{metrics['loss']:.3f}")
    if tcfg["log_every"] and trainer.step % tcfg["log_every"] == 0:
      logging.info("step %d loss %.4f grad_norm %.3f lr %.2e", trainer.step, metrics["loss"],
                   metrics["grad_norm"], metrics["learning_rate"])
      history.append({"step": trainer.step, **metrics})
    if (tcfg["eval_every"] and trainer.step % tcfg["eval_every"] == 0
        and trainer.step < tcfg["steps"]):
      ev = evaluate()
      logging.info("step %d validation %s", trainer.step, ev)
      history.append({"step": trainer.step, **_validation(ev)})
    if manager is not None and tcfg["checkpoint_every"] and \
        trainer.step % tcfg["checkpoint_every"] == 0:
      trainer.save(manager, {"data": iterator.state()})
  bar.close()
  train_seconds = time.perf_counter() - start
  if manager is not None and manager.latest_step() != trainer.step:
    trainer.save(manager, {"data": iterator.state()})
  return history, recent, train_seconds


def train_and_evaluate(config: Any, workdir: str | None = None) -> TrainResult:
  """Trains `Transformer.from_config(config.model)` on `config.data` per `config.train`;
  with a workdir, checkpoints to `workdir/checkpoints` and resumes from the latest.

  Returns:
    A TrainResult; `metrics`: `steps`, `train_loss`, `validation_loss`,
    `validation_bits_per_byte`, `train_seconds`.

  Raises:
    ValueError: invalid config values, naming the key.
  """
  spec = transformer_lib.resolve_config(config.model)  # validate everything before any work
  tcfg = check_train_config(config.train)
  dataset = data_lib.dataset_from_config(config.data)
  if tcfg["batch_size"] > dataset.train_rows.shape[0]:
    raise ValueError(f"train.batch_size must be at most the {dataset.train_rows.shape[0]} training "
                     f"rows; got {tcfg['batch_size']}")
  model = transformer_lib.Transformer(spec, rngs=nnx.Rngs(tcfg["seed"]))
  trainer = Trainer(model, tcfg)
  iterator = dataset.train_iterator(tcfg["batch_size"], seed=tcfg["seed"])
  manager = None
  if workdir is not None:
    manager = checkpoint_manager(os.path.join(workdir, "checkpoints"))
    if manager.latest_step() is not None:
      extra = trainer.restore(manager)
      iterator.restore(extra["data"])
      logging.info("resumed from step %d", trainer.step)

  def evaluate():
    n = tcfg["eval_batches"] or None
    return trainer.evaluate(data_lib.eval_batches(dataset.validation_rows, tcfg["batch_size"], n))

  history, recent, train_seconds = _train_loop(trainer, iterator, tcfg, manager, evaluate)
  ev = evaluate()
  logging.info("final validation loss %.4f bits/byte %.4f", ev["loss"], ev["bits_per_byte"])
  metrics = {"steps": trainer.step, "train_loss": float(np.mean(recent)) if recent else math.nan,
             "validation_loss": ev["loss"], "validation_bits_per_byte": ev["bits_per_byte"],
             "train_seconds": train_seconds}
  history.append({"step": trainer.step, "validation_loss": ev["loss"],
                  "validation_bits_per_byte": ev["bits_per_byte"]})
  return TrainResult(trainer.model, metrics, history)


def default_config(**model_overrides: Any) -> config_dict.ConfigDict:
  """A full config (`model`, `data`, `train`) with default sections; `model` overrides apply."""
  cfg = config_dict.ConfigDict()
  cfg.model = transformer_lib.model_config(**model_overrides)
  cfg.data = data_lib.data_config()
  cfg.train = train_config()
  return cfg


ATTENTION_PARAMS = nnx.All(nnx.Param, nnx.PathContains("attn"))
"""`Trainer(trainable=)` filter of the attention layers' parameters (`layers[i].attn`)."""


def token_eval_batches(rows: np.ndarray, batch_size: int, max_batches: int | None = None
                       ) -> Iterable[np.ndarray]:
  """`rows` in order in batches of `batch_size` (the last one may be smaller, never padded:
  a subword vocabulary has no free padding id)."""
  stop = rows.shape[0] if not max_batches else min(rows.shape[0], max_batches * batch_size)
  return (rows[i:min(i + batch_size, stop)] for i in range(0, stop, batch_size))


def uptrain(model: transformer_lib.Transformer, dataset: data_lib.Dataset, cfg: Any, *,
            attention_only: bool = False, checkpoint_dir: str | None = None,
            pad_id: int = -1) -> TrainResult:
  """Continues training a pretrained or converted model on `dataset`, resumably (the
  uptraining of Ainslie et al. 2023 §2.1 and of MHA2MLA, Ji et al. 2025).

  Args:
    model: the LM; taken over by the trainer (use the result's `model`).
    dataset: `train_rows` and `validation_rows` of token ids.
    cfg: the `train` section.
    attention_only: train only `ATTENTION_PARAMS`.
    checkpoint_dir: orbax directory to save to and resume from (the frozen parameters
      come from `model`), or None.
    pad_id: masked target id (-1: none).

  Returns:
    A TrainResult: the trained model; `metrics`: `steps`, `train_loss`, `validation_loss`,
    `validation_perplexity`, `train_seconds`.

  Raises:
    ValueError: a bad `train` config or a batch larger than the train rows.
  """
  tcfg = check_train_config(cfg)
  if tcfg["batch_size"] > dataset.train_rows.shape[0]:
    raise ValueError(f"train.batch_size must be at most the {dataset.train_rows.shape[0]} training "
                     f"rows; got {tcfg['batch_size']}")
  trainer = Trainer(model, tcfg, trainable=ATTENTION_PARAMS if attention_only else nnx.Param,
                    pad_id=pad_id)
  iterator = dataset.train_iterator(tcfg["batch_size"], seed=tcfg["seed"])
  manager = None
  if checkpoint_dir is not None:
    manager = checkpoint_manager(checkpoint_dir)
    if manager.latest_step() is not None:
      iterator.restore(trainer.restore(manager)["data"])
      logging.info("resumed from step %d", trainer.step)

  def evaluate():
    return trainer.evaluate_tokens(token_eval_batches(
        dataset.validation_rows, tcfg["batch_size"], tcfg["eval_batches"]))

  history, recent, train_seconds = _train_loop(trainer, iterator, tcfg, manager, evaluate)
  ev = evaluate()
  history.append({"step": trainer.step, **_validation(ev)})
  metrics = {"steps": trainer.step, "train_loss": float(np.mean(recent)) if recent else math.nan,
             **_validation(ev), "train_seconds": train_seconds}
  return TrainResult(trainer.model, metrics, history)
