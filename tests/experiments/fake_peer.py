"""A stand-in peer for tests of `experiments.benchmarks.real`: speaks the peer protocol, no torch.

Returns fixed seconds and the prompt's first token repeated, so a test can
check every field the bench derives from a peer's answer.
"""

import sys

from experiments.benchmarks.peers import protocol


def main() -> None:
  request = protocol.read_request(sys.argv)
  batch, new_tokens = len(request["prompts"]), int(request["new_tokens"])

  def run_once():
    return {"prefill_s": 2.0, "decode_s": 4.0, "prefill_cpu_s": 1.0, "decode_cpu_s": 3.0,
            "tokens": [[request["prompts"][b][0]] * new_tokens for b in range(batch)],
            "weight_bytes": 1000, "cache_bytes_per_token": 10}

  protocol.serve({"system": "fake", "version": "0"}, run_once)


if __name__ == "__main__":
  main()
