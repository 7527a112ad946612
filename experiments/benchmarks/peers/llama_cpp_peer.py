"""llama.cpp peer of `experiments.benchmarks.real` (`xllamacpp`, the same GGUF as shipped).

`xllamacpp` is a prebuilt CPU wheel of llama.cpp with its server code
in-process: `xllamacpp.Server(params).handle_completions(request)` runs one
completion and returns llama.cpp's own `timings` (`prompt_ms` for the prompt,
`predicted_ms` for the generated tokens after the first). Batch 1 only: the
in-process server runs a batch as parallel slots, which it did not schedule
evenly here (per-slot rates 7-29 tok/s at 8 slots, issue 31), so batch > 1
against llama.cpp is left out.

Request extras (besides `protocol.py`'s): `cache_type` "f16" (llama.cpp's
default KV cache) or "q8_0". Per `run`: one completion of the prompt ids with
`n_predict = new_tokens`, greedy (temperature 0, top_k 1), `ignore_eos`, no
prompt reuse (`cache_prompt` false), `threads` threads for prompt and decode;
prefill seconds = `prompt_ms`, decode seconds = `predicted_ms` scaled to
`new_tokens - 1` steps so that the decode rate is llama.cpp's own
`predicted_per_second` (`predicted_n / predicted_ms`). The weight bytes are the GGUF's tensor bytes as stored
(read with `gguf`); cache bytes per token: f16 K and V (2 bytes per element)
or q8_0 (34 bytes per 32 elements). The generated text is returned (this API
returns no token ids). Never imported by kvattn or its tests; needs the
`[peers]` extra.
"""

from __future__ import annotations

import sys
import time

import gguf
import xllamacpp

from experiments.benchmarks.peers import protocol

CACHE_TYPES = {"f16": ("GGML_TYPE_F16", 2.0), "q8_0": ("GGML_TYPE_Q8_0", 34 / 32)}
"""`cache_type` -> (ggml type name, bytes per cached element)."""


def main() -> None:
  """Runs the llama.cpp peer (module doc); SystemExit naming the batch or cache type when
  unsupported."""
  request = protocol.read_request(sys.argv)
  prompts = request["prompts"]
  if len(prompts) != 1:
    raise SystemExit(f"llama_cpp_peer runs batch 1 only; got batch {len(prompts)}")
  cache_type = request.get("cache_type", "f16")
  if cache_type not in CACHE_TYPES:
    raise SystemExit(f"cache_type must be one of {sorted(CACHE_TYPES)}; got {cache_type!r}")
  ids = [int(t) for t in prompts[0]]
  new_tokens = int(request["new_tokens"])
  threads = int(request["threads"])
  path = request["gguf"]
  reader = gguf.GGUFReader(path)
  weight_bytes = int(sum(int(t.n_bytes) for t in reader.tensors))

  def field(key):
    f = reader.fields[key]
    return int(f.parts[f.data[0]][0])

  arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
  layers, kv_heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv")
  head_dim = field(f"{arch}.embedding_length") // field(f"{arch}.attention.head_count")
  ggml_name, per_element = CACHE_TYPES[cache_type]
  cache_bytes_per_token = int(2 * layers * kv_heads * head_dim * per_element)

  params = xllamacpp.CommonParams()
  params.model.path = path
  params.n_ctx = len(ids) + new_tokens + 8
  params.n_batch = params.n_ubatch = 512
  params.n_parallel = 1
  params.cpuparams.n_threads = threads
  params.cpuparams_batch.n_threads = threads
  params.cache_type_k = params.cache_type_v = getattr(xllamacpp.ggml_type, ggml_name)
  params.sampling.temp = 0.0
  params.sampling.top_k = 1
  server = xllamacpp.Server(params)
  completion = {"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False}

  def run_once():
    cpu = time.process_time()
    out = server.handle_completions(dict(completion))
    cpu = time.process_time() - cpu
    if "timings" not in out:
      raise RuntimeError(f"llama.cpp returned no timings: {str(out)[:300]}")
    t = out["timings"]
    prefill_s = t["prompt_ms"] / 1e3
    # Scaled so that (N - 1) / decode_s is llama.cpp's own predicted_per_second.
    decode_s = t["predicted_ms"] / 1e3 * (new_tokens - 1) / t["predicted_n"]
    total = prefill_s + decode_s
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_cpu_s": cpu * prefill_s / total, "decode_cpu_s": cpu * decode_s / total,
            "tokens": [], "text": [out["choices"][0]["text"]],
            "weight_bytes": weight_bytes, "cache_bytes_per_token": cache_bytes_per_token,
            "predicted_n": t["predicted_n"], "prompt_n": t["prompt_n"]}

  protocol.serve({"system": f"llama_cpp_{cache_type}", "version": xllamacpp.__version__,
                  "cache_type": cache_type}, run_once)


if __name__ == "__main__":
  main()
