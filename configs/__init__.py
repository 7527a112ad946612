"""ml_collections experiment configs."""


def check_arg(arg, args=("", "smoke")):
  """`arg` ("" for None) if it is one of `args` (a config file's `:arg`), else ValueError."""
  arg = arg or ""
  if arg not in args:
    raise ValueError(f"config argument must be one of {args} (':smoke' selects the small run); "
                     f"got {arg!r}")
  return arg
