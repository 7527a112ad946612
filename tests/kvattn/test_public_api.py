"""kvattn's public names: `__all__` resolves and the module docstring lists every name."""

import kvattn


def test_every_public_name_resolves_and_is_documented():
  for name in kvattn.__all__:
    assert getattr(kvattn, name) is not None, name
    assert f"`{name}`" in kvattn.__doc__, name


def test_every_subpackage_face_resolves():
  for package in (kvattn.caches, kvattn.paging, kvattn.models, kvattn.checkpoints,
                  kvattn.inference, kvattn.training):
    for name in package.__all__:
      assert getattr(package, name) is not None, (package.__name__, name)


def test_the_readme_paths_resolve_after_import_kvattn():
  # Written this way in the README: reachable with no other import.
  assert callable(kvattn.models.convert.regroup_kv_heads)
  assert callable(kvattn.checkpoints.hub.register)
  assert callable(kvattn.caches.checkpoint.save_caches)
  assert callable(kvattn.sharding.make_mesh)
  assert callable(kvattn.train.uptrain)
