from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from . import services

EXPIRY_CHOICES = (("", "never"), ("7", "in 7 days"), ("30", "in 30 days"), ("90", "in 90 days"), ("365", "in a year"))


@login_required
@require_http_methods(["GET", "POST"])
def token_list(request):
    """The user's API tokens and a form for a new one; a token just created is shown here once, never again."""
    context = {"expiry_choices": EXPIRY_CHOICES, "errors": {}, "created": None, "value": None}
    status = 200
    if request.method == "POST":
        name = request.POST.get("name", "")
        expiry = request.POST.get("expires_in_days", "")
        try:
            days = int(expiry) if expiry.strip() else None
        except ValueError:
            days = expiry
        try:
            context["created"], context["value"] = services.issue_api_token(request.user, name, days)
            status = 201
        except services.TokenInputError as error:
            context |= {"errors": error.errors, "name": name}
            status = 400
    context["tokens"] = services.tokens_of(request.user)
    return render(request, "accounts/tokens.html", context, status=status)


@login_required
@require_POST
def token_revoke(request, token_id: int):
    services.revoke_api_token(request.user, token_id)
    return redirect("tokens")
