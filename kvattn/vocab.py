"""The byte-level vocabulary's ids: each UTF-8 byte (0..255), then BOS, EOS and padding.

`kvattn.training.data` tokenizes with them; `kvattn.inference` pads with `PAD_ID`, so
inference needs no import of training.
"""

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258  # never a training target
VOCAB_SIZE = 259
