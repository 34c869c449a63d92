import os

from celery import Celery
from celery.signals import after_setup_logger, after_setup_task_logger

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "loom.settings")

app = Celery("loom")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@after_setup_logger.connect
@after_setup_task_logger.connect
def write_worker_logs_as_configured(logger, **kwargs) -> None:
    """A worker's handlers are Celery's own, set up after Django's LOGGING took effect: with
    LOOM_LOG_FORMAT=json they write what the web processes write. Text stays Celery's format."""
    from django.conf import settings

    from loom.operations.structured_logs import write_json

    if settings.LOOM_LOG_FORMAT == "json":
        write_json(logger)
