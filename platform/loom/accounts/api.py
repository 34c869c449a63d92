"""The signed-in user's API tokens: listed without their values, created (the value shown once), revoked."""

from datetime import datetime

from ninja import Router, Schema, Status

from loom.api.errors import Body, FieldErrors, Name

from . import services

router = Router(tags=["tokens"])


class TokenIn(Body):
    name: Name
    # Null or absent: the token never expires.
    expires_in_days: int | None = None


class TokenOut(Schema):
    id: int
    name: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None


class TokenCreatedOut(TokenOut):
    # The token itself: this answer is the only place it ever appears.
    token: str


@router.get("/tokens", response=list[TokenOut])
def list_tokens(request):
    """The user's tokens, newest first: name, when created, last used and when it expires; never the value."""
    return services.tokens_of(request.user)


@router.post("/tokens", response={201: TokenCreatedOut, 400: FieldErrors})
def create_token(request, body: TokenIn):
    """A new token for the user, expiring after `expires_in_days` days (null: never); its value is in this
    answer only."""
    try:
        token, value = services.issue_api_token(request.user, body.name, body.expires_in_days)
    except services.TokenInputError as error:
        return Status(400, {"errors": error.errors})
    token.token = value
    return Status(201, token)


@router.delete("/tokens/{token_id}", response={204: None})
def revoke_token(request, token_id: int):
    """Revoke one of the user's tokens: requests with it are refused (401) from now on."""
    services.revoke_api_token(request.user, token_id)
    return Status(204, None)
