"""Lossless speculative generation: the Drafter protocol, request and event types, prompt layout, prefill,
draft trees, verification, coupled sampling, the draft budget, the engine and its stats."""
