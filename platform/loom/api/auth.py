from functools import wraps

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from ninja.security import HttpBearer, django_auth

from loom.accounts.services import user_for_api_token

from .errors import UNAUTHORIZED


class ApiTokenAuth(HttpBearer):
    """`Authorization: Bearer <token>` from `manage.py create_api_user`, for scripts."""

    def authenticate(self, request, token):
        user = user_for_api_token(token)
        if user is not None:
            request.user = user
        return user


# Scripts use a token; pages use their session (ninja's session auth enforces CSRF).
user_auth = [ApiTokenAuth(), django_auth]


def docs_access(view):
    """The OpenAPI document and its docs page, for a logged-in browser or a script with its API token.
    A script that sends a token is answered 401 when the token is bad: a redirect to the login page
    would hand it HTML where it expects the schema."""
    browser_view = login_required(view)

    @wraps(view)
    def guarded(request, *args, **kwargs):
        if "Authorization" not in request.headers:
            return browser_view(request, *args, **kwargs)
        if ApiTokenAuth()(request) is None:
            return JsonResponse({"errors": {"authorization": UNAUTHORIZED}}, status=401)
        return view(request, *args, **kwargs)

    return guarded
