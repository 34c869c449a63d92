"""API tokens for websockets: a script (`loom run watch`) opens a run's socket with `Authorization: Bearer
<token>` in its handshake, as it calls the REST API. A handshake without the header keeps its session user."""

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from django.contrib.auth.models import AnonymousUser

from .services import user_for_api_token


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of the handshake's Authorization header ("" for one that is no bearer token); None without one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class ApiTokenAuthMiddleware(BaseMiddleware):
    """Sets scope["user"] to the token's user; a bad token makes the socket anonymous, so its consumer refuses it,
    whatever session cookie came with it (as the API answers a bad token 401 whatever the session)."""

    async def __call__(self, scope, receive, send):
        token = bearer_token(scope.get("headers", []))
        if token is not None:
            user = await database_sync_to_async(user_for_api_token)(token) if token else None
            scope = {**scope, "user": user or AnonymousUser()}
        return await super().__call__(scope, receive, send)
