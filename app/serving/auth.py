"""Bearer API keys. Each key is a tenant; with no keys configured everyone is the default tenant."""

from __future__ import annotations

import hashlib
import hmac

from app.errors import Unauthorized
from retrieval.store import DEFAULT_TENANT


def tenant_of_key(key: str) -> str:
    """A stable tenant id for a key (the key itself is never stored or logged)."""
    return "t-" + hashlib.sha256(key.encode()).hexdigest()[:20]


class KeyRing:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._tenants = {k: tenant_of_key(k) for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @staticmethod
    def same(token: str, secret: str) -> bool:
        """Constant-time comparison of a presented token with a configured secret."""
        return hmac.compare_digest(token.encode(), secret.encode())

    def tenant(self, token: str | None) -> str:
        """The tenant of a Bearer token; ``Unauthorized`` when keys are configured and it is not one."""
        if not self._tenants:
            return DEFAULT_TENANT
        if not token:
            raise Unauthorized()
        for key, tenant in self._tenants.items():
            if self.same(token, key):
                return tenant
        raise Unauthorized("unknown API key")
