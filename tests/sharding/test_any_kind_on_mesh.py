"""Kinds placed from their declared logical axes on 2 simulated CPU devices (a subprocess:
the device count is fixed when JAX starts): an evicting cache, the test-only pageable kind
(tests/kvattn/caches/toy_paged_kind.py) and the test-only policy of a module outside kvattn
(tests/experiments/user_policy.py) keep their kind, hold the shardings their axes name, and
`generate` / the `ContinuousBatcher` give the single-device tokens."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _checks() -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import kvattn  # pylint: disable=g-import-not-at-top
  from kvattn import sharding  # pylint: disable=g-import-not-at-top
  from kvattn.caches import registry, sharded  # pylint: disable=g-import-not-at-top
  from kvattn.models import transformer  # pylint: disable=g-import-not-at-top
  from tests.experiments import user_policy  # pylint: disable=g-import-not-at-top
  from tests.kvattn.caches import toy_paged_kind  # pylint: disable=g-import-not-at-top

  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  data, heads = sharding.make_mesh((2, 1, 1)), sharding.make_mesh((1, 2, 1))
  prompts = np.random.default_rng(0).integers(0, 256, (2, 9)).astype(np.int32)
  lengths = np.array([9, 6], np.int32)
  out = {}
  for kind, spec in (("h2o", {"kind": "h2o", "budget": 6}),
                     ("toy_paged", {"kind": "toy_paged", "page_size": 4})):
    want, _ = kvattn.generate(model, prompts, lengths, 6,
                              cache_factory=registry.cache_factory_from_config(model, spec))
    placed = sharded.init_caches(model, 2, 16, data, kind=spec)
    got, _ = kvattn.generate(sharding.place_model(model, data), prompts, lengths, 6,
                             cache_factory=sharded.cache_factory(model, data, kind=spec))
    by_heads = sharded.place_caches(registry.build_caches(model, 2, 16, None, spec,
                                                          tokens_per_seq=[16, 16]), heads)
    first = "k" if kind == "h2o" else "k_pages"
    out[kind] = dict(type=type(placed[0]).__name__, tokens_equal=np.array_equal(got, want),
                     data_spec=list(getattr(placed[0], first).sharding.spec),
                     heads_spec=list(getattr(by_heads[0], first).sharding.spec),
                     heads_type=type(by_heads[0]).__name__)
  assert out["toy_paged"]["type"] == toy_paged_kind.ToyPagedKVCache.__name__
  # The user's policy through the batcher on the data-parallel mesh.
  spec = {"kind": user_policy.NAME, "budget": 6}
  requests = [(i, prompts[i % 2, :lengths[i % 2]].tolist(), 5 + i) for i in range(3)]
  opts = dict(num_slots=2, num_pages=2, page_size=4, max_len=16, max_prompt_len=9, cache=spec)
  want = kvattn.ContinuousBatcher(model, **opts).run(requests)
  batcher = kvattn.ContinuousBatcher(model, mesh=data, **opts)
  got = batcher.run(requests)
  out["batcher"] = dict(tokens_equal=all(np.array_equal(got[i].tokens, want[i].tokens)
                                         for i in want),
                        k_spec=list(batcher.caches[0].k.sharding.spec)[:1],
                        devices=len(batcher.caches[0].k.sharding.device_set))
  del jax, P
  return out


@pytest.mark.slow  # a subprocess with 2 devices (~25 CPU-s), as the other mesh batcher checks
def test_any_kind_is_placed_from_its_logical_axes():
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             JAX_PLATFORMS="cpu",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
  proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["h2o"] == dict(type="EvictingKVCache", tokens_equal=True,
                            data_spec=["data", None, None, None],
                            heads_spec=[None, "model", None, None],
                            heads_type="EvictingKVCache")
  assert out["toy_paged"] == dict(type="ToyPagedKVCache", tokens_equal=True,
                                  data_spec=[None, "data", None, None],
                                  heads_spec=["model", None, None, None],
                                  heads_type="ToyPagedKVCache")
  assert out["batcher"] == dict(tokens_equal=True,
                                k_spec=["data"], devices=2)


if __name__ == "__main__":
  print(json.dumps(_checks()))
