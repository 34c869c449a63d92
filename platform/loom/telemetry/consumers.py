from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from loom.runs.models import Run

from .services import run_group


class RunEventsConsumer(AsyncJsonWebsocketConsumer):
    """Pushes a run's events to its page as they are stored. Delivery is best effort:
    the page keeps the last seq it applied and fills any gap from the REST events API."""

    async def connect(self):
        user = self.scope.get("user")
        run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        if user is None or not user.is_authenticated or not await self._owns(user, run_id):
            # Closing before accepting refuses the handshake itself (HTTP 403): nothing is sent.
            await self.close()
            return
        self.group = run_group(run_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def run_events(self, message):
        await self.send_json({"type": "events", "events": message["events"], "sent": message.get("sent")})

    @database_sync_to_async
    def _owns(self, user, run_id: int) -> bool:
        return Run.objects.filter(pk=run_id, owner=user).exists()
