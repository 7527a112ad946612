"""Evaluations every family and benchmark shares: one model loader (`models`), one source
of text and passkey prompts (`text`), one streaming evaluation and greedy decode
(`streaming`)."""
