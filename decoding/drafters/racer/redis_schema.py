"""The Redis tier's key schema, its encodings and its update script (one atomic call per batch of contexts).

Keys (``prefix`` defaults to ``ragspec:dc``)::

    {prefix}:{ns}:c:{ctx}   HASH  field = continuation: int32 little-endian token ids (1..L tokens, the
                                  first is the token right after the context); value = decayed count
                                  (float). Field "_t" = unix time the counts were last decayed to.
                                  EXPIRE = ttl_s, refreshed on every update.
    {prefix}:{ns}:idx       ZSET  member = {ctx}, score = unix time of the context's last update. Used to
                                  sweep expired contexts and to keep at most max_contexts per namespace
                                  (oldest dropped first). EXPIRE = ttl_s.

    {prefix}:{ns}:a:{scope}  LIST  the namespace's latest answers over one scope (a document set), newest first:
                                  int32 little-endian token ids each; LTRIM to max_answers, EXPIRE = ttl_s.

    ns  = "{m=<model id>;t=<tokenizer hash>;u=<sha256(tenant)[:16]>}"  (braces: a Redis Cluster hash tag,
          so one namespace lives in one slot and the update script may touch all its keys)
    ctx = blake2b-64 hex digest of the context's int32 little-endian bytes
    scope = blake2b-64 hex digest of the scope string (the prompt's prefix key: it names the documents)

Memory per namespace is bounded by max_contexts x max_continuations x (4 L + ~40) bytes plus Redis overhead.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from urllib.parse import urlsplit


def context_hash(context: Sequence[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(context)}i", *context), digest_size=8).hexdigest()


def encode_continuation(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def decode_continuation(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 4}i", raw)


def context_prefix(key_prefix: str, tag: str) -> str:
    """Every context key of namespace ``tag`` starts with this (the script deletes by it)."""
    return f"{key_prefix}:{tag}:c:"


def answers_key(key_prefix: str, tag: str, scope: str) -> str:
    return f"{key_prefix}:{tag}:a:{hashlib.blake2b(scope.encode(), digest_size=8).hexdigest()}"


def index_key(key_prefix: str, tag: str) -> str:
    return f"{key_prefix}:{tag}:idx"


def redact_url(url: str | None) -> str:
    """A connection URL fit for a log line: scheme, host, port and path; never the user or password."""
    try:
        parts = urlsplit(url or "")
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # an unparsable port: name nothing rather than echo the URL
        return "<redis url>"
    return f"{parts.scheme}://{host}{port}{parts.path}"



# KEYS[1] = index zset, KEYS[2..] = context hashes. ARGV: now, ttl, half life, max continuations,
# max contexts, context key prefix, then per context: member, n, n × (field, increment).
LEARN_LUA = """
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local half = tonumber(ARGV[3])
local max_conts = tonumber(ARGV[4])
local max_ctx = tonumber(ARGV[5])
local prefix = ARGV[6]
local a = 7
for k = 2, #KEYS do
  local key = KEYS[k]
  local member = ARGV[a]
  local n = tonumber(ARGV[a + 1])
  a = a + 2
  local t = tonumber(redis.call('HGET', key, '_t'))
  if t == nil then
    redis.call('HSET', key, '_t', tostring(now))
  elseif now > t then
    local f = math.pow(0.5, (now - t) / half)
    if f < 0.999 then
      local all = redis.call('HGETALL', key)
      for i = 1, #all, 2 do
        if all[i] ~= '_t' then
          local v = tonumber(all[i + 1]) * f
          if v < 0.01 then
            redis.call('HDEL', key, all[i])
          else
            redis.call('HSET', key, all[i], tostring(v))
          end
        end
      end
      redis.call('HSET', key, '_t', tostring(now))
    end
  end
  local fresh = {}
  for j = 1, n do
    redis.call('HINCRBYFLOAT', key, ARGV[a], ARGV[a + 1])
    fresh[ARGV[a]] = true
    a = a + 2
  end
  local excess = redis.call('HLEN', key) - 1 - max_conts
  if excess > 0 then
    local all = redis.call('HGETALL', key)
    local old, new = {}, {}
    for i = 1, #all, 2 do
      if all[i] ~= '_t' then
        local e = {all[i], tonumber(all[i + 1])}
        if fresh[all[i]] then table.insert(new, e) else table.insert(old, e) end
      end
    end
    local weaker = function(x, y) return x[2] < y[2] end
    table.sort(old, weaker)
    table.sort(new, weaker)
    for _, group in ipairs({old, new}) do
      for _, e in ipairs(group) do
        if excess <= 0 then break end
        redis.call('HDEL', key, e[1])
        excess = excess - 1
      end
    end
  end
  redis.call('EXPIRE', key, ttl)
  redis.call('ZADD', KEYS[1], now, member)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local over = redis.call('ZCARD', KEYS[1]) - max_ctx
if over > 0 then
  local gone = redis.call('ZPOPMIN', KEYS[1], over)
  for i = 1, #gone, 2 do redis.call('DEL', prefix .. gone[i]) end
end
redis.call('EXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
"""
