"""The detectors: plain functions from a run's recent telemetry to findings, no database and no state.

Each takes the rows a step's telemetry left (evaluate.py reads them) and the run's `alerts` config, and
answers what it sees now. Spikes are judged one step at a time against the window of steps before it by a
robust z-score (median and scaled median absolute deviation, which one outlier cannot drag along the way a
mean and standard deviation can); conditions (a drop, creep, a straggler) by the latest steps.
"""

import functools
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainer.config import AlertsConfig, ParallelConfig
from trainer.plan.memory import rank_coordinates

NON_FINITE = "non_finite"
LOSS_SPIKE = "loss_spike"
GRAD_NORM_SPIKE = "grad_norm_spike"
THROUGHPUT_DROP = "throughput_drop"
MEMORY_CREEP = "memory_creep"
OVERFIT = "overfit"
STRAGGLER = "straggler"
RANK_EXIT = "rank_exit"
HANG = "hang"
EXPERT_COLLAPSE = "expert_collapse"
EXPERT_IMBALANCE = "expert_imbalance"

CRITICAL = "critical"
WARNING = "warning"

# The median absolute deviation of normally distributed values times this is their standard deviation.
MAD_TO_SIGMA = 1.4826
# A window of identical values has no spread; a value must then still stand out by this fraction of the
# median (or by an absolute hair for a median of zero) to count as a deviation at all.
RELATIVE_SPREAD_FLOOR = 1e-3
ABSOLUTE_SPREAD_FLOOR = 1e-12
# The experts or layers an expert alert's message names; its details hold them all.
SHOWN_EXPERT_ENTRIES = 8


@dataclass(frozen=True)
class StepRow:
    """One step of the run as a whole: its loss and gradient norm (the same on every rank that reports
    them), the mean of the ranks' tokens/s, and the highest memory of any rank with the rank holding it."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    memory_bytes: int | None = None
    memory_rank: int | None = None
    # The step's wall time: the slowest rank's.
    step_time_s: float | None = None
    # Validation loss, on the steps the run evaluated.
    eval_loss: float | None = None
    # The tokens each expert of each mixture-of-experts layer received over the global batch, by layer index:
    # merged from every pipeline stage (each reports its own layers). Empty for a dense model.
    expert_loads: Mapping[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    rule: str
    step: int
    severity: str
    message: str
    rank: int | None = None
    ranks: tuple[int, ...] = ()
    details: dict = field(default_factory=dict)


def robust_z(value: float, history: Sequence[float]) -> float:
    """How many scaled median absolute deviations `value` lies above the median of `history`."""
    median = statistics.median(history)
    deviation = statistics.median(abs(item - median) for item in history) * MAD_TO_SIGMA
    spread = max(deviation, RELATIVE_SPREAD_FLOOR * abs(median), ABSOLUTE_SPREAD_FLOOR)
    return (value - median) / spread


def _values(rows: Iterable[StepRow], name: str) -> list[tuple[int, float]]:
    return [(row.step, value) for row in rows if (value := getattr(row, name)) is not None and math.isfinite(value)]


def loss_spikes(rows: Sequence[StepRow], config: AlertsConfig, after_step: int) -> list[Finding]:
    """Steps past `after_step` whose loss is a spike by the z-score or by the multiple of the window's highest."""
    findings = []
    for step, loss, history in _judged(_values(rows, "loss"), config, after_step):
        z = robust_z(loss, history)
        highest = max(history)
        median = statistics.median(history)
        by_z = z >= config.loss_spike_z and loss >= (1 + config.loss_spike_rise) * median
        if by_z or loss > config.loss_spike_factor * highest:
            message = f"loss {loss:.4g} at step {step}: {z:.1f} robust deviations above the median {median:.4g}"
            if loss > config.loss_spike_factor * highest:
                message += f", over {config.loss_spike_factor:g}× the window's highest ({highest:.4g})"
            details = {"value": loss, "median": median, "z": round(z, 2), "highest": highest}
            findings.append(Finding(LOSS_SPIKE, step, WARNING, message, details=details))
    return findings


def grad_norm_spikes(rows: Sequence[StepRow], config: AlertsConfig, after_step: int) -> list[Finding]:
    findings = []
    for step, norm, history in _judged(_values(rows, "grad_norm"), config, after_step):
        z = robust_z(norm, history)
        median = statistics.median(history)
        if z >= config.grad_norm_spike_z and norm >= config.grad_norm_spike_ratio * median:
            message = (
                f"gradient norm {norm:.4g} at step {step}: {z:.1f} robust deviations above the median {median:.4g}"
            )
            details = {"value": norm, "median": median, "z": round(z, 2)}
            findings.append(Finding(GRAD_NORM_SPIKE, step, WARNING, message, details=details))
    return findings


def _judged(series: list[tuple[int, float]], config: AlertsConfig, after_step: int):
    """Each (step, value, the window of values before it) past `after_step` with enough history."""
    for index, (step, value) in enumerate(series):
        if step <= after_step:
            continue
        history = [item for _, item in series[max(0, index - config.window) : index]]
        if len(history) >= config.min_history:
            yield step, value, history


def throughput_drop(rows: Sequence[StepRow], config: AlertsConfig) -> list[Finding]:
    """The last steps, at least throughput_drop_steps of them and at least throughput_drop_min_s of training,
    each below (1 − throughput_drop) × the median of the window before them. The time floor keeps a few
    short steps slowed by something passing (a checkpoint save, a busy host) from being a drop."""
    series = [row for row in rows if row.tokens_per_s is not None]
    count = drop_span(series, config)
    if count is None:
        return []
    recent, before = series[-count:], series[:-count]
    history = [row.tokens_per_s for row in before[-config.window :]]
    if len(history) < config.min_history:
        return []
    median = statistics.median(history)
    floor = (1 - config.throughput_drop) * median
    if not all(row.tokens_per_s < floor for row in recent):
        return []
    latest = recent[-1]
    seconds = sum(row.step_time_s or 0.0 for row in recent)
    message = (
        f"tokens/s {latest.tokens_per_s:,.0f} at step {latest.step}, below {floor:,.0f} "
        f"({1 - config.throughput_drop:.0%} of the median {median:,.0f}) for {count} steps ({seconds:,.1f} s)"
    )
    details = {"value": latest.tokens_per_s, "median": median, "steps": [row.step for row in recent]}
    details["seconds"] = round(seconds, 3)
    return [Finding(THROUGHPUT_DROP, latest.step, WARNING, message, details=details)]


def drop_span(series: Sequence[StepRow], config: AlertsConfig) -> int | None:
    """How many of the last steps a drop is judged over: throughput_drop_steps, or more until they hold
    throughput_drop_min_s of training; None when the rows hold too few."""
    seconds = 0.0
    for count, row in enumerate(reversed(series), start=1):
        seconds += row.step_time_s or 0.0
        if count >= config.throughput_drop_steps and seconds >= config.throughput_drop_min_s:
            return count
    return None


def memory_creep(rows: Sequence[StepRow], config: AlertsConfig) -> list[Finding]:
    """The highest memory of any rank, over a full window past the warmup steps, rising from third to third by
    memory_creep in all."""
    series = [row for row in rows if row.memory_bytes is not None and row.step > config.memory_warmup_steps]
    series = series[-config.window :]
    if len(series) < max(config.min_history, 3) or len(series) < config.window:
        return []
    third = len(series) // 3
    first, middle, last = (
        statistics.median(row.memory_bytes for row in part)
        for part in (series[:third], series[third : 2 * third], series[2 * third :])
    )
    if not (first <= middle <= last and last >= (1 + config.memory_creep) * first):
        return []
    latest = series[-1]
    message = (
        f"memory of rank {latest.memory_rank} rose from {first / 2**20:,.0f} to {last / 2**20:,.0f} MiB "
        f"(+{last / first - 1:.0%}) over steps {series[0].step}–{latest.step}"
    )
    details = {"first_third_bytes": first, "last_third_bytes": last, "steps": [series[0].step, latest.step]}
    rank = latest.memory_rank
    return [Finding(MEMORY_CREEP, latest.step, WARNING, message, rank=rank, ranks=(rank,), details=details)]


def overfit(rows: Sequence[StepRow], config: AlertsConfig) -> list[Finding]:
    """Validation loss higher at each of the last overfit_evaluations evaluations than at the one before, by
    overfit_rise in all, while training loss fell over those steps (the median of the later half of its steps
    below the earlier half's): the model is learning its training data rather than the task. A run that never
    evaluates, or whose training loss rises too (diverging), raises nothing."""
    evaluations = _values(rows, "eval_loss")[-(config.overfit_evaluations + 1) :]
    if len(evaluations) <= config.overfit_evaluations:
        return []
    (first_step, first), (last_step, last) = evaluations[0], evaluations[-1]
    rising = all(later > earlier for (_, earlier), (_, later) in itertools.pairwise(evaluations))
    if not rising or last < (1 + config.overfit_rise) * first:
        return []
    training = [loss for step, loss in _values(rows, "loss") if first_step <= step <= last_step]
    if len(training) < 2:
        return []
    half = len(training) // 2
    before, after = statistics.median(training[:half]), statistics.median(training[-half:])
    if after >= before:
        return []
    message = (
        f"validation loss rose from {first:.4g} to {last:.4g} (+{last / first - 1:.1%}) over the evaluations at "
        f"steps {first_step}–{last_step} while training loss fell from {before:.4g} to {after:.4g}: the model is "
        "overfitting its training data; stop at the checkpoint before the rise, or train on more data"
    )
    details = {
        "steps": [step for step, _ in evaluations],
        "eval_losses": [value for _, value in evaluations],
        "train_loss_before": before,
        "train_loss_after": after,
    }
    return [Finding(OVERFIT, last_step, WARNING, message, details=details)]


def expert_collapse(rows: Sequence[StepRow], config: AlertsConfig) -> list[Finding]:
    """Experts of mixture-of-experts layers that received under expert_collapse_share of an even share of their
    layer's tokens (its mean load) in each of their layer's latest expert_collapse_steps steps or more: one
    finding naming each with its layer. A router that sends an expert (almost) nothing has stopped training it:
    the model holds an expert it no longer uses."""
    if not config.expert_collapse_share:
        return []
    collapsed = []
    for layer, series in sorted(_layer_series(rows).items()):
        last_step, load = series[-1]
        even = sum(load) / len(load)
        for expert, first_step in sorted(_starved_since(series, config.expert_collapse_share).items()):
            if last_step - first_step + 1 >= config.expert_collapse_steps:
                collapsed.append(
                    {
                        "layer": layer,
                        "expert": expert,
                        "tokens": load[expert],
                        "even_share": round(even, 1),
                        "of_even_share": round(load[expert] / even, 4),
                        "steps": [first_step, last_step],
                    }
                )
    if not collapsed:
        return []
    threshold = _percent(config.expert_collapse_share)
    if len(collapsed) == 1:
        (entry,) = collapsed
        first_step, last_step = entry["steps"]
        message = (
            f"expert {entry['expert']} of layer {entry['layer']} collapsed: {entry['tokens']:,} tokens at step "
            f"{last_step} against an even share of {entry['even_share']:,.0f} ({entry['of_even_share']:.1%}), under "
            f"{threshold} of one in each of steps {first_step}–{last_step}"
        )
    else:
        named = _listed(
            collapsed,
            lambda entry: f"expert {entry['expert']} of layer {entry['layer']} ({entry['of_even_share']:.1%})",
        )
        message = (
            f"{len(collapsed)} experts collapsed, each under {threshold} of an even share of its layer's tokens for "
            f"{config.expert_collapse_steps} steps or more: {named}"
        )
    step = max(entry["steps"][1] for entry in collapsed)
    details = {"experts": collapsed, "threshold": config.expert_collapse_share}
    return [Finding(EXPERT_COLLAPSE, step, WARNING, message, details=details)]


def expert_imbalance(rows: Sequence[StepRow], config: AlertsConfig) -> list[Finding]:
    """Mixture-of-experts layers whose busiest expert received over expert_imbalance_ratio × the layer's mean
    load in each of the layer's latest expert_imbalance_steps steps or more: one finding naming each layer with
    its ratio. The busiest expert sets the step's pace (its tokens are the most work any expert-parallel rank
    has) and, with a capacity, the tokens it drops."""
    if not config.expert_imbalance_ratio:
        return []
    imbalanced = []
    for layer, series in sorted(_layer_series(rows).items()):
        spell = _latest_spell(series, lambda load: max(load) > config.expert_imbalance_ratio * _mean(load))
        if len(spell) < config.expert_imbalance_steps:
            continue
        ratios = [max(load) / _mean(load) for _, load in spell]
        last_step, load = spell[-1]
        imbalanced.append(
            {
                "layer": layer,
                "busiest_expert": load.index(max(load)),
                "ratio": round(ratios[-1], 3),
                "highest_ratio": round(max(ratios), 3),
                "steps": [spell[0][0], last_step],
            }
        )
    if not imbalanced:
        return []
    threshold = f"{config.expert_imbalance_ratio:g}×"
    if len(imbalanced) == 1:
        (entry,) = imbalanced
        first_step, last_step = entry["steps"]
        message = (
            f"layer {entry['layer']}'s expert load is imbalanced: expert {entry['busiest_expert']} received "
            f"{entry['ratio']:.2f}× the layer's mean load at step {last_step}, over {threshold} in each of steps "
            f"{first_step}–{last_step}"
        )
    else:
        named = _listed(
            imbalanced,
            lambda entry: f"layer {entry['layer']} ({entry['ratio']:.2f}×, expert {entry['busiest_expert']})",
        )
        message = (
            f"{len(imbalanced)} layers' expert loads are imbalanced, the busiest expert of each over {threshold} the "
            f"layer's mean load for {config.expert_imbalance_steps} steps or more: {named}"
        )
    step = max(entry["steps"][1] for entry in imbalanced)
    details = {"layers": imbalanced, "threshold": config.expert_imbalance_ratio}
    return [Finding(EXPERT_IMBALANCE, step, WARNING, message, details=details)]


def _listed(entries: list[dict], describe: Callable[[dict], str]) -> str:
    """The first SHOWN_EXPERT_ENTRIES entries described, an ellipsis after them where there are more."""
    named = ", ".join(describe(entry) for entry in entries[:SHOWN_EXPERT_ENTRIES])
    return named + (" …" if len(entries) > SHOWN_EXPERT_ENTRIES else "")


def _layer_series(rows: Iterable[StepRow]) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """Each mixture-of-experts layer's (step, tokens per expert), in the rows' step order."""
    series: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for row in rows:
        for layer, load in row.expert_loads.items():
            series.setdefault(layer, []).append((row.step, load))
    return series


def _latest_spell(
    series: list[tuple[int, tuple[int, ...]]], holds: Callable[[tuple[int, ...]], bool]
) -> list[tuple[int, tuple[int, ...]]]:
    """A layer's latest steps, in order, each the step after the one before it, at every one of which `holds`.
    A step the layer did not report breaks the spell: "consecutive" is never guessed across it."""
    spell: list[tuple[int, tuple[int, ...]]] = []
    for step, load in reversed(series):
        if (spell and step != spell[-1][0] - 1) or not holds(load):
            break
        spell.append((step, load))
    return spell[::-1]


def _starved_since(series: list[tuple[int, tuple[int, ...]]], share: float) -> dict[int, int]:
    """The experts under `share` of an even share of the layer's tokens at its latest step, each with the first
    step of its unbroken spell of such steps. One walk back over the steps for all the layer's experts, which
    stops at the first step none of those still starved was."""
    since: dict[int, int] = {}
    starved: set[int] | None = None
    later_step = None
    for step, load in reversed(series):
        if later_step is not None and (step != later_step - 1 or len(load) != len(series[-1][1])):
            break
        floor = share * _mean(load)
        below = {expert for expert, tokens in enumerate(load) if tokens < floor}
        starved = below if starved is None else starved & below
        if not starved:
            break
        since |= dict.fromkeys(starved, step)
        later_step = step
    return since


def _mean(load: tuple[int, ...]) -> float:
    return sum(load) / len(load)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def stragglers(
    step_times: dict[int, dict[int, float]],
    config: AlertsConfig,
    host: Callable[[int], str],
    measure: str = "step time",
    peer_group: Callable[[int], str] = lambda rank: "",
) -> list[Finding]:
    """Ranks whose time stayed above their peers' median / straggler_score, and straggler_min_excess_s above
    it, in each of the latest steps (each with at least two ranks reporting), for at least straggler_steps
    steps and straggler_min_s seconds of their own time: one finding per rank, naming its host. `measure`
    names what the times are in the message.

    The time floor is what keeps a busy host from being a straggler: a rank that loses its CPU for a few
    short steps (two ranks sharing two cores with the rest of a machine) is slow for a moment, not slow.

    A rank's peers are the ranks with the same `peer_group` (named in the message when not empty): ranks
    that do different work, as a pipeline's stages do, are never measured against each other, and a rank
    alone in its group has no one to be slower than."""
    steps = sorted(step for step, times in step_times.items() if len(times) >= 2)
    medians: dict[int, dict[int, float]] = {}
    slow: dict[int, set[int]] = {}
    for step in steps:
        slow[step] = set()
        for group in _peer_groups(step_times[step], peer_group):
            median = statistics.median(group.values())
            for rank, seconds in group.items():
                medians.setdefault(rank, {})[step] = median
                if seconds > 0 and median / seconds < config.straggler_score:
                    if seconds - median >= config.straggler_min_excess_s:
                        slow[step].add(rank)
    findings = []
    for rank in sorted(slow[steps[-1]] if steps else ()):
        streak = _slow_streak(rank, steps, slow)
        times = [step_times[step][rank] for step in streak]
        if len(streak) < config.straggler_steps or sum(times) < config.straggler_min_s:
            continue
        shown = streak[-config.straggler_steps :]
        median = medians[rank][streak[-1]]
        node = host(rank)
        where = f" on {node}" if node else ""
        group = peer_group(rank)
        among = f" among the ranks of {group}" if group else ""
        message = (
            f"rank {rank}{where} is a straggler: {measure} {times[-1]:.3g} s against a median of "
            f"{median:.3g} s{among} (score {median / times[-1]:.2f} < {config.straggler_score:g}) for "
            f"{len(streak)} steps ({sum(times):,.1f} s)"
        )
        details = {
            "host": node,
            "steps": shown,
            "step_times": [step_times[step][rank] for step in shown],
            "medians": [medians[rank][step] for step in shown],
            "score": round(min(medians[rank][step] / step_times[step][rank] for step in streak), 3),
            "peer_group": group,
            "slow_steps": len(streak),
            "seconds": round(sum(times), 3),
        }
        findings.append(Finding(STRAGGLER, steps[-1], WARNING, message, rank=rank, ranks=(rank,), details=details))
    return findings


def _slow_streak(rank: int, steps: list[int], slow: dict[int, set[int]]) -> list[int]:
    """The latest steps, in order, in each of which `rank` was slow."""
    streak = []
    for step in reversed(steps):
        if rank not in slow[step]:
            break
        streak.append(step)
    return streak[::-1]


def straggler_history_needed(findings: list[Finding], config: AlertsConfig) -> int:
    """How many steps of history would show whether these candidates (found on too short a history to hold
    straggler_min_s) stay slow that long: at their current own time a step, with one step to spare."""
    needed = 0
    for finding in findings:
        per_step = max(min(finding.details["step_times"]), 1e-3)
        needed = max(needed, config.straggler_steps, math.ceil(config.straggler_min_s / per_step) + 1)
    return needed


def pipeline_peers(parallel: ParallelConfig) -> Callable[[int], str]:
    """A rank's peer group for `stragglers`: its pipeline rank. The pipeline is the one mesh dim whose
    positions do different work (the first stage embeds, the last computes the output layer and the loss,
    and stages may hold unequal layers); tp, cp and data-parallel positions split a stage's work evenly (cp
    in load-balanced chunks), so the ranks of one pipeline rank do the same work."""
    if parallel.pp == 1:
        return lambda rank: ""

    @functools.cache
    def group(rank: int) -> str:
        return f"pipeline rank {rank_coordinates(parallel, rank)['pp']}"

    return group


def _peer_groups(times: dict[int, float], peer_group: Callable[[int], str]) -> list[dict[int, float]]:
    """One step's times split by peer group, leaving out groups of one."""
    groups: dict[str, dict[int, float]] = {}
    for rank, seconds in times.items():
        groups.setdefault(peer_group(rank), {})[rank] = seconds
    return [group for group in groups.values() if len(group) >= 2]


def non_finite(reports: Iterable[tuple[int, int, str, object]]) -> list[Finding]:
    """From (rank, step, metric name, value) of the metrics just stored: one finding for the first step whose
    loss or gradient norm is NaN or infinite, naming every rank that reported a non-finite value."""
    bad: dict[int, dict[int, set[str]]] = {}
    for rank, step, name, value in reports:
        if not is_finite(value):
            bad.setdefault(step, {}).setdefault(rank, set()).add(name)
    if not bad:
        return []
    step = min(bad)
    ranks = tuple(sorted(bad[step]))
    names = sorted(set().union(*bad[step].values()))
    shown = ", ".join(str(rank) for rank in ranks[:8]) + (" …" if len(ranks) > 8 else "")
    message = f"{' and '.join(names)} not finite at step {step} on {len(ranks)} rank(s): {shown}"
    details = {"metrics": names, "steps": sorted(bad)}
    return [Finding(NON_FINITE, step, CRITICAL, message, ranks=ranks, details=details)]


def is_finite(value: object) -> bool:
    """Non-finite floats travel as the strings "NaN", "Infinity" and "-Infinity" (JSON has no bare NaN)."""
    if isinstance(value, str):
        return value not in ("NaN", "Infinity", "-Infinity")
    return not isinstance(value, float) or math.isfinite(value)
