from django.apps import AppConfig
from django.db.backends.signals import connection_created


class TelemetryConfig(AppConfig):
    name = "loom.telemetry"

    def ready(self):
        from .median import register_on_sqlite

        connection_created.connect(register_on_sqlite)
