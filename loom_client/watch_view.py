"""What `loom run watch` draws: the latest steps (loss, tokens/s, alerts) and a bar to the run's last step."""

from dataclasses import dataclass, field

from rich.console import Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .models import Alert, Event, RunDetail

ROWS_SHOWN = 12


@dataclass
class StepRow:
    attempt: int | None
    step: int
    loss: float | None = None
    tokens_per_s: float | None = None


@dataclass
class WatchView:
    run: RunDetail
    rows: dict[tuple[int | None, int], StepRow] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    last_seq: int = 0

    def __post_init__(self):
        self.progress = Progress(
            TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), auto_refresh=False
        )
        self.bar = self.progress.add_task("steps", total=self.run.config.get("steps") or None)

    def add(self, events: list[Event]) -> None:
        for event in events:
            self.last_seq = max(self.last_seq, event.seq)
            if event.kind == "metric" and event.step is not None:
                self._add_metric(event)
        latest = self.run.latest_attempt
        steps = [row.step for row in self.rows.values() if latest is None or row.attempt == latest.number]
        completed = max(steps, default=0)
        # A restore may have moved the last step past the run's (the API tells an attempt's layout, not its steps).
        total = max(self.run.config.get("steps") or 0, completed) or None
        self.progress.update(self.bar, completed=completed, total=total)

    def _add_metric(self, event: Event) -> None:
        row = self.rows.setdefault((event.attempt, event.step), StepRow(event.attempt, event.step))
        loss = event.payload.get("loss_mean")
        if isinstance(loss, int | float):
            row.loss = loss
        # As the run page counts it: rank 0's tokens/s times the data-parallel degree of its attempt.
        tokens_per_s = event.payload.get("tokens_per_s")
        if event.rank == 0 and isinstance(tokens_per_s, int | float):
            row.tokens_per_s = tokens_per_s * self._data_parallel(event.attempt)

    def _data_parallel(self, number: int | None) -> int:
        attempt = next((attempt for attempt in self.run.attempts if attempt.number == number), None)
        parallel = attempt.parallel if attempt is not None else self.run.config.get("parallel", {})
        return int(parallel.get("dp_replicate", 1)) * int(parallel.get("dp_shard", 1))

    def __rich__(self) -> Group:
        latest = self.run.latest_attempt
        attempt = f", attempt {latest.number} {latest.state}" if latest else ""
        table = Table(title=f"run {self.run.id} {self.run.name}: {self.run.state}{attempt}", title_justify="left")
        for name in ("attempt", "step", "loss", "tokens/s", "alerts"):
            table.add_column(name, justify="left" if name == "alerts" else "right", overflow="fold")
        for row in sorted(self.rows.values(), key=lambda row: (row.attempt or 0, row.step))[-ROWS_SHOWN:]:
            rules = ", ".join(sorted({alert.rule for alert in self.alerts if alert.step == row.step}))
            table.add_row(
                str(row.attempt or ""),
                str(row.step),
                "" if row.loss is None else f"{row.loss:.4f}",
                "" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}",
                rules,
            )
        live = [alert for alert in self.alerts if alert.state != "resolved"]
        lines = [Text(f"{alert.severity} alert: {alert.rule} at step {alert.step}: {alert.message}") for alert in live]
        return Group(table, self.progress, *lines)
