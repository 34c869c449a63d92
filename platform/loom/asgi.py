import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "loom.settings")
django_http = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from loom.accounts.socket_auth import ApiTokenAuthMiddleware  # noqa: E402
from loom.alerts.routing import websocket_urlpatterns as alert_sockets  # noqa: E402
from loom.telemetry.ingest_app import ingest_endpoint  # noqa: E402
from loom.telemetry.routing import websocket_urlpatterns as run_sockets  # noqa: E402

INGEST_PATH = "/api/ingest"


async def http(scope, receive, send):
    """Telemetry ingest takes its own lean path (every rank posts to it every second); the rest is Django."""
    if scope["path"] == INGEST_PATH:
        await ingest_endpoint(scope, receive, send)
    else:
        await django_http(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http,
        # A page's socket carries its session; a script's (loom run watch) its API token, which wins when sent.
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(ApiTokenAuthMiddleware(URLRouter(run_sockets + alert_sockets)))
        ),
    }
)

# Django, the apps and their imports are objects that live as long as the process. Frozen, the cyclic
# collector stops walking them in each full collection: at a thousand ingest requests a second those walks
# had stalled the event loop and the group commit for 70-180 ms every few seconds. A young generation of
# 20,000 objects (700 by default) lets a request's objects die before a collection looks at them, instead
# of being promoted and walked again: about 200 collections over 2 ms a minute became about 20.
gc.collect()
gc.freeze()
gc.set_threshold(20_000, 10, 10)
