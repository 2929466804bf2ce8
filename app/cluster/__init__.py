"""Serving beyond one process: routing requests to replicas by document."""
