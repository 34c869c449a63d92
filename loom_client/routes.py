"""Every platform endpoint the client calls, named once: its HTTP method, its path template, and the query
parameters and body fields it may send. tests/client/test_api_drift.py checks each against the platform's
OpenAPI document."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    query: tuple[str, ...] = ()
    body: tuple[str, ...] = ()

    def url(self, **path_parameters: object) -> str:
        return self.path.format(**path_parameters)


SUBMIT_RUN = Route("POST", "/api/runs", body=("name", "config", "cluster"))
LIST_RUNS = Route("GET", "/api/runs", query=("search", "state", "tag", "archived", "sort", "limit", "cursor"))
SHOW_RUN = Route("GET", "/api/runs/{run_id}")
EDIT_RUN = Route("PATCH", "/api/runs/{run_id}", body=("name", "tags", "note", "archived"))
CANCEL_RUN = Route("POST", "/api/runs/{run_id}/cancel")
RUN_EVENTS = Route("GET", "/api/runs/{run_id}/events", query=("after", "limit"))
RANK_LOG = Route("GET", "/api/runs/{run_id}/attempts/{number}/logs/{rank}", query=("lines",))
RUN_CHECKPOINTS = Route("GET", "/api/runs/{run_id}/checkpoints")
RESTORE = Route(
    "POST", "/api/runs/{run_id}/restore", body=("checkpoint", "mode", "parallel", "steps", "name", "lr", "skip_steps")
)
RUN_ALERTS = Route("GET", "/api/runs/{run_id}/alerts", query=("state",))

HTTP_ROUTES = (
    SUBMIT_RUN,
    LIST_RUNS,
    SHOW_RUN,
    EDIT_RUN,
    CANCEL_RUN,
    RUN_EVENTS,
    RANK_LOG,
    RUN_CHECKPOINTS,
    RESTORE,
    RUN_ALERTS,
)

# Not in the OpenAPI document (it describes HTTP only): the run page's websocket, platform/loom/telemetry/routing.py.
RUN_SOCKET = "/ws/runs/{run_id}/"
