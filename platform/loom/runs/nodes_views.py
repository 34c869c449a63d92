"""The Nodes page. Thin: loom.runs.nodes decides what a user sees, frontend/static/nodes.js excludes and
includes through the API."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import reverse

from .backends import current_backend
from .nodes import NOT_REPORTED, node_table


@login_required
def node_list(request):
    table = node_table(request.user, current_backend())
    rows = [{"node": row, "exclude_url": reverse("api:exclude_node", args=[row.name])} for row in table.rows]
    context = {"backend": table.backend, "unavailable": table.unavailable, "rows": rows, "not_reported": NOT_REPORTED}
    return render(request, "runs/nodes.html", context)
