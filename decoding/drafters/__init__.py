"""Drafters: the registry of decoding modes (``registry``), prompt lookup, RACER and RAPID."""
