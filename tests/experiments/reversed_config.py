"""The main job's smoke config on the test-only cache kind "reversed" (one point).

Importing the kind's file registers it; nothing else in kvattn or experiments names it.
"""

from configs import default
from tests.kvattn.caches import reversed_kind  # noqa: F401  (registers cache kind "reversed")


def get_config(arg: str = ""):
  del arg
  config = default.get_config("smoke")
  config.cache.kind = "reversed"
  return config


def get_sweep(arg: str = ""):
  del arg
  return [{}]
