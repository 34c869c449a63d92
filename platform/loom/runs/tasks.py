from celery import shared_task

from . import launcher


@shared_task(name="loom.launch_attempt", acks_late=False)
def launch_attempt(attempt_id: int) -> str:
    """Run one attempt to completion. Safe to deliver twice: only the first delivery claims it."""
    return launcher.launch(attempt_id)
