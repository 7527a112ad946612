"""ml_collections experiment configs, and the pieces several of them share."""

from ml_collections import config_dict


def check_arg(arg, args=("", "smoke")):
  """`arg` ("" for None) if it is one of `args` (a config file's `:arg`), else ValueError."""
  arg = arg or ""
  if arg not in args:
    raise ValueError(f"config argument must be one of {args} (':smoke' selects the small run); "
                     f"got {arg!r}")
  return arg


def named_model(name="smollm2-135m-instruct", dtype="float32"):
  """The `model` section of a family that loads its model by name."""
  model = config_dict.ConfigDict()
  model.name = name  # kvattn.from_pretrained name, or "random-tiny" (a 2-layer random GQA
  # model with the byte tokenizer, for tests).
  model.dtype = dtype  # Compute dtype (and the cache dtype, unless the config sets one).
  return model
