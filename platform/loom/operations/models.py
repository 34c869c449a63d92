from django.db import models


class PeriodicPass(models.Model):
    """When a periodic job (a Celery beat task) last finished a pass. The job runs in the monitor worker and
    /metrics is served by the web processes, so the time is kept where both reach it: the database."""

    job = models.CharField(max_length=64, primary_key=True)
    finished_at = models.DateTimeField()
