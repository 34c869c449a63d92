"""What the run page's Experts panel reads: how a mixture-of-experts run's routers spread the tokens over the
experts of each layer, step by step, sized to the chart rather than to the run.

The trainer's metric events carry it (`experts`: per layer the whole global batch's tokens per expert, the
token copies dropped past capacity and the balance loss), sent by one rank per pipeline stage for the layers
its stage holds: a step's layers are the union over those ranks. The answer starts with the run's last_seq,
read before the rows, as every chart answer does (charts.py).
"""

from dataclasses import dataclass, field

from django.db.models import Max, Min

from loom.runs.models import Run
from trainer.config import ModelConfig, parse_config

from .charts import ChartInputError, attempt_of, last_seq_of
from .downsample import bucket_width
from .models import Event

# Layer × expert × column cells one answer holds at most (the rank × step heatmap's bound): 32 layers of
# 64 experts get 128 columns; the page asks for one layer at a time and gets up to a column per pixel.
CELLS_MAX = 256 * 1024
PER_LAYER = ("load", "imbalance", "dropped", "balance_loss")


@dataclass
class _Column:
    """One layer's reports of the steps in one column, summed up."""

    load: list[int]
    dropped: int = 0
    # The highest of its steps' imbalances: one step routed all onto one expert stays on the chart.
    imbalance: float | None = None
    balance_losses: list[float] = field(default_factory=list)

    def add(self, report: dict) -> None:
        for expert, tokens in enumerate(report["load"]):
            self.load[expert] += tokens
        self.dropped += report.get("dropped") or 0
        imbalance = load_imbalance(report["load"])
        if imbalance is not None and (self.imbalance is None or imbalance > self.imbalance):
            self.imbalance = imbalance
        if isinstance(report.get("balance_loss"), int | float):
            self.balance_losses.append(report["balance_loss"])

    def values(self) -> dict:
        losses = self.balance_losses
        return {
            "load": self.load,
            "imbalance": self.imbalance,
            "dropped": self.dropped,
            "balance_loss": sum(losses) / len(losses) if losses else None,
        }


def load_imbalance(load: list[int]) -> float | None:
    """The busiest expert's tokens over the mean expert's: 1 is perfectly even, the number of experts is
    everything on one. None for a step that routed nothing."""
    total = sum(load)
    return max(load) * len(load) / total if total else None


def moe_layers(model: ModelConfig) -> list[str]:
    """The layers that route tokens, named as the trainer reports them: every block of a mixture-of-experts
    model, none of a dense one."""
    return [str(layer) for layer in range(model.layers)] if model.experts > 1 else []


def expert_load(
    run: Run,
    width: int,
    number: int | None = None,
    start: int | None = None,
    end: int | None = None,
    layers: list[str] | None = None,
) -> dict:
    """Per layer (those asked for, else every one) and column of steps: the tokens each expert received, the
    highest load imbalance (max / mean over experts) of its steps, the token copies dropped and the mean
    balance loss; null where the layer has no report in the column. A column is one step while the steps fit
    `width` columns (and the answer CELLS_MAX cells), else `span` consecutive steps summed."""
    last_seq = last_seq_of(run)
    attempt = attempt_of(run, number)
    model = parse_config(attempt.config).model
    routed = moe_layers(model)
    shown = routed if layers is None else layers
    unknown = [layer for layer in shown if layer not in routed]
    if unknown:
        raise ChartInputError({"layers": f"no mixture-of-experts layers {unknown}; valid choices are {routed}"})
    answer = {
        "last_seq": last_seq,
        "attempt": attempt.number,
        "experts": model.experts,
        "top_k": model.top_k,
        "layers": routed,
    }
    reports = Event.objects.filter(attempt=attempt, kind="metric", payload__has_key="experts")
    bounds = _step_range(reports, start, end)
    if not shown or bounds is None:
        return answer | {"span": 1, "steps": []} | {name: {layer: [] for layer in shown} for name in PER_LAYER}
    first, last = bounds
    span = bucket_width(first, last, max(1, min(width, CELLS_MAX // (len(shown) * model.experts))))
    columns: dict[str, dict[int, _Column]] = {layer: {} for layer in shown}
    for step, reported in reports.filter(step__gte=first, step__lte=last).values_list("step", "payload__experts"):
        if not isinstance(reported, dict):
            continue
        for layer, report in reported.items():
            if layer in columns and _well_formed(report, model.experts):
                column = columns[layer].setdefault((step - first) // span, _Column(load=[0] * model.experts))
                column.add(report)
    filled = sorted({column for layer_columns in columns.values() for column in layer_columns})
    values = {
        layer: [layer_columns[column].values() if column in layer_columns else None for column in filled]
        for layer, layer_columns in columns.items()
    }
    per_layer = {
        name: {layer: [None if cell is None else cell[name] for cell in cells] for layer, cells in values.items()}
        for name in PER_LAYER
    }
    return answer | {"span": span, "steps": [first + column * span for column in filled]} | per_layer


def _step_range(reports, start: int | None, end: int | None) -> tuple[int, int] | None:
    """[start, end] clipped to the steps whose expert load the attempt reported; None when none is there."""
    bounds = reports.aggregate(first=Min("step"), last=Max("step"))
    if bounds["first"] is None:
        return None
    first = bounds["first"] if start is None else max(start, bounds["first"])
    last = bounds["last"] if end is None else min(end, bounds["last"])
    return (first, last) if first <= last else None


def _well_formed(report, experts: int) -> bool:
    """Whether a layer's report is one this answer can sum: ingest stores a payload as the rank sent it, and
    one malformed report must not take the panel down."""
    if not isinstance(report, dict) or not isinstance(report.get("load"), list) or len(report["load"]) != experts:
        return False
    counts = [*report["load"], report.get("dropped") or 0]
    return all(isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in counts)
