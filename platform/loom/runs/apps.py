from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "loom.runs"

    def ready(self) -> None:
        from loom.telemetry.store import events_stored

        from .lifecycle import on_events_stored

        events_stored.connect(on_events_stored, dispatch_uid="loom.runs.lifecycle")
