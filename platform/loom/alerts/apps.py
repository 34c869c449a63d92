from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "loom.alerts"

    def ready(self) -> None:
        from loom.telemetry.store import events_stored

        from .watch import notice_stored_metrics

        events_stored.connect(notice_stored_metrics, dispatch_uid="loom.alerts.watch")
