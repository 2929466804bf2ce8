"""KV caches: a request's slot cache, the prefix cache (device, host and disk tiers) and KV memory sizing."""
