"""Decoding for ragspec: the target, its drafters and lossless speculative generation.

Rooms, each importing only the ones after it (``tests/test_libraries.py`` keeps it so):

- ``drafters/``: the registry of decoding modes and the drafters (prompt lookup, RACER, RAPID);
- ``speculative/``: the Drafter protocol, request and event types, prompt layout, prefill, draft trees,
  verification, coupled sampling, the draft budget, the engine and its stats;
- ``runtime/``: model loading, the quantized CPU runtime and its kernels, rope, attention, device transfers;
- ``cache/``: the KV caches (a request's slot cache, the prefix cache's tiers, KV memory sizing);
- ``errors``: the domain errors every room raises.

Never imports ``app`` or ``retrieval``; never reads environment variables or settings.
"""
