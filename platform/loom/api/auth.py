from ninja.security import HttpBearer, django_auth

from loom.accounts.services import user_for_api_token


class ApiTokenAuth(HttpBearer):
    """`Authorization: Bearer <token>` from `manage.py create_api_user`, for scripts."""

    def authenticate(self, request, token):
        user = user_for_api_token(token)
        if user is not None:
            request.user = user
        return user


# Scripts use a token; pages use their session (ninja's session auth enforces CSRF).
user_auth = [ApiTokenAuth(), django_auth]
