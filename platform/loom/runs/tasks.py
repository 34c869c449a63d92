from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.utils import timezone

from loom.operations.structured_logs import run_context

from . import launcher, reconciler, states
from .backends import backend_named
from .models import Attempt
from .services import CANCEL_TASK, LAUNCH_TASK, send_launch

BACKEND_FULL_RETRY_S = 2.0


@shared_task(
    name=LAUNCH_TASK,
    acks_late=False,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    retry_backoff_max=30,
    max_retries=20,
)
def launch_attempt(attempt_id: int) -> str:
    """Claim the attempt and hand it to the launch backend; returns once it is submitted. Safe to deliver
    twice: only the first delivery claims it. While the backend is full the attempt stays queued and its
    launch comes back after BACKEND_FULL_RETRY_S, without holding a worker's slot meanwhile."""
    run_id = Attempt.objects.filter(pk=attempt_id).values_list("run_id", flat=True).first()
    with run_context(run_id, attempt_id):
        outcome = launcher.launch(attempt_id)
    if outcome == "full":
        Attempt.objects.filter(pk=attempt_id, state=states.QUEUED).update(launch_sent_at=timezone.now())
        launch_attempt.apply_async(args=[attempt_id], countdown=BACKEND_FULL_RETRY_S)
    return outcome


@shared_task(name="loom.runs.reconcile", acks_late=False, ignore_result=True)
def reconcile() -> dict:
    """Celery beat's pass over every active attempt (reconciler.py)."""
    result = reconciler.reconcile(send_launch)
    return {"relaunched": result.relaunched, "running": result.running, "ended": result.ended}


@shared_task(name=CANCEL_TASK, acks_late=False, ignore_result=True)
def cancel_attempt(attempt_id: int) -> None:
    """Tell the backend at once; the reconciler repeats it every pass until the attempt is gone."""
    attempt = Attempt.objects.filter(pk=attempt_id, backend_handle__isnull=False).first()
    if attempt is not None:
        with run_context(attempt.run_id, attempt.pk):
            backend_named(attempt.backend or "local").cancel(attempt.backend_handle, settings.LOOM_CANCEL_GRACE_S)
