from django.apps import AppConfig


class OperationsConfig(AppConfig):
    name = "loom.operations"

    def ready(self) -> None:
        from .collectors import register_scrape_time_collectors
        from .metrics import registry

        register_scrape_time_collectors(registry)
