"""The last pass of periodic jobs, for the lag operators alert on."""

from datetime import datetime

from django.utils import timezone

from .models import PeriodicPass

RECONCILE = "reconcile"


def record_pass(job: str) -> None:
    PeriodicPass.objects.update_or_create(job=job, defaults={"finished_at": timezone.now()})


def seconds_since_pass(job: str, now: datetime) -> float | None:
    """None while the job has never finished a pass."""
    finished_at = PeriodicPass.objects.filter(job=job).values_list("finished_at", flat=True).first()
    return None if finished_at is None else (now - finished_at).total_seconds()
