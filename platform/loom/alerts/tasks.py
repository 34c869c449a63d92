from celery import shared_task

from .hangs import check_hangs
from .notify import announce
from .webhooks import deliver_webhook

__all__ = ["check_hangs_task", "deliver_webhook"]


@shared_task(name="loom.alerts.check_hangs", acks_late=False, ignore_result=True)
def check_hangs_task() -> int:
    """Run by Celery beat every LOOM_HANG_CHECK_INTERVAL_S; answers how many alerts it opened."""
    results = check_hangs()
    for changes in results:
        announce(changes)
    return sum(len(changes.opened) for changes in results)
