import json

from django.core.management.base import BaseCommand, CommandError

from loom.runs.models import Run
from loom.runs.services import RunInputError

from ... import services


def layout_change(assignment: str) -> tuple[str, object]:
    """ "tp=2" → ("tp", 2); values are read as JSON, so "pp_schedule=1F1B" stays a string."""
    field, separator, value = assignment.partition("=")
    if not separator or not field:
        raise CommandError(f"--set takes FIELD=VALUE (a field of the parallel section), got {assignment!r}")
    try:
        return field.strip(), json.loads(value)
    except ValueError:
        return field.strip(), value


class Command(BaseCommand):
    help = (
        "List a run's checkpoints, or restore one as the run's next attempt or as a new run forked from it, "
        "optionally in another parallel layout (validated like any config)."
    )

    def add_arguments(self, parser):
        parser.add_argument("run", type=int, help="the run's id")
        parser.add_argument("--restore", type=int, metavar="STEP", help="restore the committed checkpoint of STEP")
        parser.add_argument("--fork", action="store_true", help="into a new run instead of the next attempt")
        parser.add_argument("--name", help="the forked run's name")
        parser.add_argument(
            "--set",
            dest="changes",
            action="append",
            default=[],
            metavar="FIELD=VALUE",
            help="change a parallel field, e.g. --set tp=2 --set dp_replicate=1",
        )
        parser.add_argument("--steps", type=int, help="train to this step instead of the saved config's")

    def handle(self, *args, run, restore, fork, name, changes, steps, **options):
        found = Run.objects.filter(pk=run).select_related("owner").first()
        if found is None:
            raise CommandError(f"no run {run}")
        checkpoints = list(services.checkpoints_of(found))
        if restore is None:
            for checkpoint in checkpoints:
                layout = " ".join(f"{key}={value}" for key, value in sorted(checkpoint.layout.items()))
                self.stdout.write(
                    f"step {checkpoint.step:>8}  attempt {checkpoint.attempt.number}  {checkpoint.state:<9}  "
                    f"{checkpoint.bytes / 1e6:9.1f} MB  {layout}  {checkpoint.path}"
                )
            return
        committed = [c for c in checkpoints if c.step == restore and c.state == "committed"]
        if not committed:
            steps_there = ", ".join(str(c.step) for c in checkpoints if c.state == "committed") or "none"
            raise CommandError(
                f"run {run} has no committed checkpoint of step {restore}; committed steps: {steps_there}"
            )
        parallel = dict(layout_change(assignment) for assignment in changes) or None
        try:
            attempt = services.restore(
                found.owner, found, committed[-1].pk, "fork" if fork else "attempt", parallel, steps, name
            )
        except RunInputError as error:
            raise CommandError("\n".join(f"{field}: {message}" for field, message in error.errors.items())) from None
        self.stdout.write(f"run {attempt.run_id} attempt {attempt.number} queued: {attempt.trigger_note}")
