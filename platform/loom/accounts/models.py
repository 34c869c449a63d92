from django.conf import settings
from django.db import models


class ApiToken(models.Model):
    """A user's token for scripts. Only its SHA-256 is stored; the token is shown once. Revoking deletes it."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Null: never expires. From then on the token is refused.
    expires_at = models.DateTimeField(null=True, blank=True)
    # When a request last authenticated with it, to the minute (see services.user_for_api_token).
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.user} / {self.name}"
