"""The run pages. Thin: services decide, templates show, frontend/static/run.js keeps the run page live."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.urls import reverse

from trainer.config import world_size_of

from . import services, states
from .forms import NewRunForm, restore_inputs


@login_required
def run_list(request):
    return render(request, "runs/list.html", {"runs": services.runs_for(request.user)})


@login_required
def new_run(request):
    if request.method != "POST":
        return render(request, "runs/new.html", {"form": NewRunForm()})
    form = NewRunForm(request.POST)
    try:
        run = services.create_run(request.user, *form.run_input())
    except services.RunInputError as error:
        form.add_input_errors(error.errors)
        return render(request, "runs/new.html", {"form": form}, status=400)
    return redirect("run-detail", run_id=run.pk)


@login_required
def run_detail(request, run_id: int):
    run = services.run_for(request.user, run_id)
    latest = services.latest_attempt(run)
    page = {
        "state": run.state,
        "ranks": world_size_of(latest.config),
        "attempt": latest.number,
        "apiUrl": reverse("api:run_detail", args=[run.pk]),
        "urls": {
            "checkpoints": reverse("api:run_checkpoints", args=[run.pk]),
            "resilience": reverse("api:run_resilience", args=[run.pk]),
            "restore": reverse("api:restore", args=[run.pk]),
        },
        "socketPath": f"/ws/runs/{run.pk}/",
        "terminalStates": sorted(states.TERMINAL),
        "cancellableStates": sorted(states.ACTIVE - {states.CANCELLING}),
    }
    context = {
        "run": run,
        "attempts": run.attempts.select_related("restored_from"),
        "restore_inputs": restore_inputs(),
        "ranks": range(page["ranks"]),
        "cancellable": run.state in page["cancellableStates"],
        "page": page,
    }
    return render(request, "runs/detail.html", context)
