import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "loom.settings")

app = Celery("loom")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
