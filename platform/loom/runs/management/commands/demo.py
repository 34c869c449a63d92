from django.core.management.base import BaseCommand

from loom.accounts.services import ensure_user
from loom.runs.services import create_run

DEMO_CONFIG = {
    "steps": 400,
    "model": {"layers": 4, "dim": 128, "heads": 4, "kv_heads": 2, "ffn": 344, "seq_len": 128},
    "parallel": {"dp_replicate": 2},
    "optimizer": {"lr": 0.003, "warmup_steps": 20},
    "data": {"micro_batch": 8, "corpus_bytes": 2_000_000},
    "eval": {"interval_steps": 20, "batches": 4},
}


class Command(BaseCommand):
    help = "Create the demo login and a small demo run that trains for real on this machine."

    def add_arguments(self, parser):
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="Where the platform is served.")
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="demo")

    def handle(self, *args, url, username, password, **options):
        user = ensure_user(username, password)
        run = create_run(user, "demo: byte-level Llama on the Python standard library", DEMO_CONFIG)
        self.stdout.write(f"loom is up at {url}/  (log in as {username} / {password})")
        self.stdout.write(f"demo run: {url}/runs/{run.pk}/")
