from django.contrib.auth import get_user_model

from .models import ApiToken
from .tokens import hash_token, mint_token


def create_api_token(user, name: str = "cli") -> str:
    """Create a token for `user` and return it; this is the only time it is visible."""
    token = mint_token("loom")
    ApiToken.objects.create(user=user, name=name, key_hash=hash_token(token))
    return token


def user_for_api_token(token: str):
    found = ApiToken.objects.select_related("user").filter(key_hash=hash_token(token)).first()
    if found is None or not found.user.is_active:
        return None
    return found.user


def ensure_user(username: str, password: str | None):
    """Create the user if missing; set the password when one is given."""
    user, _ = get_user_model().objects.get_or_create(username=username)
    if password:
        user.set_password(password)
        user.save(update_fields=["password"])
    return user
