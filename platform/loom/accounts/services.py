from datetime import datetime, timedelta

from django.contrib.auth import get_user_model
from django.db.models import Q
from django.http import Http404
from django.utils import timezone

from .models import ApiToken
from .tokens import hash_token, mint_token

TOKEN_NAME_MAX_CHARS = 100
TOKEN_MAX_DAYS = 3650
# A token's last use is written at most this often: a script's every request would otherwise write a row.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenInputError(ValueError):
    """Bad input for a token; `errors` maps fields ("name", "expires_in_days") to messages."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))
        self.errors = errors


def issue_api_token(user, name: str, expires_in_days: int | None = None) -> tuple[ApiToken, str]:
    """A new token for `user` and its value, which is never visible again. Expires after `expires_in_days`
    days (None: never)."""
    errors = {}
    clean_name = name.strip() if isinstance(name, str) else ""
    if not clean_name:
        errors["name"] = "is required: say what uses the token (a script, a CI job)"
    elif len(clean_name) > TOKEN_NAME_MAX_CHARS:
        errors["name"] = f"must be at most {TOKEN_NAME_MAX_CHARS} characters"
    if expires_in_days is not None and (
        isinstance(expires_in_days, bool)
        or not isinstance(expires_in_days, int)
        or not 1 <= expires_in_days <= TOKEN_MAX_DAYS
    ):
        errors["expires_in_days"] = f"must be a whole number of days from 1 to {TOKEN_MAX_DAYS}, or empty for never"
    if errors:
        raise TokenInputError(errors)
    expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days is not None else None
    value = mint_token("loom")
    token = ApiToken.objects.create(user=user, name=clean_name, key_hash=hash_token(value), expires_at=expires_at)
    return token, value


def create_api_token(user, name: str = "cli") -> str:
    """Create a token for `user` that never expires and return it; this is the only time it is visible."""
    return issue_api_token(user, name)[1]


def tokens_of(user):
    """The user's tokens, newest first, the expired ones included (listed so they can be removed)."""
    return ApiToken.objects.filter(user=user).order_by("-created_at", "-pk")


def revoke_api_token(user, token_id: int) -> None:
    """Delete one of the user's tokens: from now on it is refused. Another user's token is not found."""
    deleted, _ = ApiToken.objects.filter(user=user, pk=token_id).delete()
    if not deleted:
        raise Http404("no such token")


def user_for_api_token(token: str, now: datetime | None = None):
    """The active user a live token belongs to, recording its use; None for an unknown, revoked or expired one."""
    now = now or timezone.now()
    found = (
        ApiToken.objects.select_related("user")
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now), key_hash=hash_token(token))
        .first()
    )
    if found is None or not found.user.is_active:
        return None
    if found.last_used_at is None or now - found.last_used_at >= LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=found.pk).update(last_used_at=now)
    return found.user


def ensure_user(username: str, password: str | None):
    """Create the user if missing; set the password when one is given."""
    user, _ = get_user_model().objects.get_or_create(username=username)
    if password:
        user.set_password(password)
        user.save(update_fields=["password"])
    return user
