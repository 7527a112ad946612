"""kvattn's public names: `__all__` resolves and the module docstring lists every name."""

import kvattn


def test_every_public_name_resolves_and_is_documented():
  for name in kvattn.__all__:
    assert getattr(kvattn, name) is not None, name
    assert f"`{name}`" in kvattn.__doc__, name
