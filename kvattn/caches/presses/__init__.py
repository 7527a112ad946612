"""Score-based presses (kvpress's names) as eviction policies and kinds, one file each.

Importing the package registers, as `eviction.POLICY_TABLE` entries and cache kinds:
"keydiff" (KeyDiff), "expected_attention", "qfilter" (its own kind, `QFilterKVCache`),
"chunkkv" (ChunkKV over SnapKV; `chunkkv.register(inner)` for another), "criticalkv"
(CriticalKV over SnapKV; `criticalkv.register(inner)`), "snapkv+knorm"
(`composed.compose(first, second)`) and "decoding_knorm" (compression during decoding;
`decoding.register(policy)` for another). docs/caches.md, "Presses".
"""

from kvattn.caches.presses import keydiff
from kvattn.caches.presses import expected_attention
from kvattn.caches.presses import qfilter
from kvattn.caches.presses import chunkkv
from kvattn.caches.presses import criticalkv
from kvattn.caches.presses import composed
from kvattn.caches.presses import decoding
from kvattn.caches.presses.composed import compose
from kvattn.caches.presses.decoding import DecodingKVCache
from kvattn.caches.presses.qfilter import QFilterKVCache, calibrate, calibration_tokens

__all__ = ["DecodingKVCache", "QFilterKVCache", "calibrate", "calibration_tokens", "chunkkv",
           "compose", "composed", "criticalkv", "decoding", "expected_attention", "keydiff", "qfilter"]
