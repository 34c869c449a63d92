"""LoomClient: the platform's REST API (and the run websocket) from anywhere the platform can be reached,
with an API token. It imports nothing of the platform: everything goes over HTTP."""

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from . import routes
from .documents import with_overrides
from .models import Alert, Checkpoint, CreatedRun, Event, EventPage, ListedRun, LogTail, Restored, RunDetail, RunPage
from .routes import Route

EVENTS_PAGE = 1000
# The most runs the platform gives in one page of its run list.
RUNS_PAGE = 200
RECONNECT_PAUSE_S = 1.0


class LoomError(Exception):
    """The platform did not give the answer asked for."""


class Unreachable(LoomError):
    """No answer at all: the address is wrong, the platform is down or the network is."""


class ApiError(LoomError):
    """The platform refused a request. `errors` maps each field (or what the refusal is about: "authorization",
    "url", "run") to its message, as the API's `{"errors": {field: message}}` does."""

    def __init__(self, status: int, errors: dict[str, str], method: str, path: str):
        self.status = status
        self.errors = errors
        self.method = method
        self.path = path
        details = "; ".join(f"{field}: {message}" for field, message in errors.items())
        super().__init__(f"{method} {path} answered {status}: {details}")

    @property
    def bad_input(self) -> bool:
        return self.status in (400, 422)

    @classmethod
    def of(cls, response: httpx.Response) -> "ApiError":
        try:
            errors = response.json()["errors"]
            if not isinstance(errors, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            # Not the platform's own answer: a proxy's error page, say. Its first words say who answered.
            errors = {"server": response.text[:300].strip() or response.reason_phrase}
        return cls(response.status_code, {str(field): str(message) for field, message in errors.items()},
                   response.request.method, response.request.url.path)  # fmt: skip


class LoomClient:
    def __init__(self, url: str, token: str, timeout: float = 30.0, transport: httpx.BaseTransport | None = None):
        """`transport`: how requests reach the platform, when not over the network (tests hand the platform's
        WSGI application to httpx.WSGITransport)."""
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=self._auth_header, timeout=timeout, transport=transport)

    @property
    def _auth_header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "LoomClient":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _call(self, route: Route, body: Any = None, query: Mapping[str, Any] | None = None, **path: Any) -> Any:
        # The route table is what the drift test checks against the API: nothing may be sent beside it.
        undeclared = (set(query or {}) - set(route.query)) | (set(body or {}) - set(route.body))
        if undeclared:
            raise ValueError(f"{route.method} {route.path} declares no parameters {sorted(undeclared)}")
        url = route.url(**path)
        try:
            response = self._http.request(route.method, url, params=query, json=body)
        except httpx.HTTPError as error:
            raise Unreachable(f"cannot reach the platform at {self.url}: {error}") from error
        if not response.is_success:
            raise ApiError.of(response)
        return response.json() if response.content else None

    # ---- runs ----

    def submit(self, name: str, config: Mapping[str, Any], cluster: Mapping[str, Any] | None = None) -> CreatedRun:
        """Create a run and queue its first attempt; with a cluster, the planner's estimate on it is stored."""
        body = {"name": name, "config": dict(config)}
        if cluster is not None:
            body["cluster"] = dict(cluster)
        return CreatedRun.model_validate(self._call(routes.SUBMIT_RUN, body))

    def runs(
        self,
        search: str = "",
        state: str | Sequence[str] = (),
        tag: str = "",
        archived: bool = False,
        sort: str = "-created",
        limit: int | None = None,
    ) -> Iterator[ListedRun]:
        """Your runs, newest first unless `sort` says otherwise (created, updated, name, state; "-name": the
        other way), page after page: those whose name, a tag or the note holds `search`, in `state` (one or
        several), tagged `tag`; `archived`: the archived runs instead of the live ones; at most `limit` runs."""
        states = [state] if isinstance(state, str) else list(state)
        query = {"search": search, "state": ",".join(states), "tag": tag, "archived": archived, "sort": sort}
        query = {name: value for name, value in query.items() if value not in ("", None)}
        left = limit
        while left is None or left > 0:
            page_size = RUNS_PAGE if left is None else min(left, RUNS_PAGE)
            page = RunPage.model_validate(self._call(routes.LIST_RUNS, query={**query, "limit": page_size}))
            yield from page.runs
            if left is not None:
                left -= len(page.runs)
            if page.next_cursor is None:
                return
            query["cursor"] = page.next_cursor

    def run(self, run_id: int) -> RunDetail:
        return RunDetail.model_validate(self._call(routes.SHOW_RUN, run_id=run_id))

    def edit(
        self,
        run_id: int,
        *,
        name: str | None = None,
        tags: Sequence[str] | None = None,
        note: str | None = None,
        archived: bool | None = None,
    ) -> RunDetail:
        """Rename a run, replace its tags, write its note, archive it (or bring it back); what is None stays."""
        fields = {"name": name, "tags": None if tags is None else list(tags), "note": note, "archived": archived}
        body = {field: value for field, value in fields.items() if value is not None}
        return RunDetail.model_validate(self._call(routes.EDIT_RUN, body, run_id=run_id))

    def tag(self, run_id: int, *tags: str) -> RunDetail:
        """Add tags to the run's (kept in lower case)."""
        current = self.run(run_id).tags
        return self.edit(run_id, tags=[*current, *tags])

    def untag(self, run_id: int, *tags: str) -> RunDetail:
        """Take tags off the run; one it does not have is no error."""
        dropped = {tag.strip().lower() for tag in tags}
        return self.edit(run_id, tags=[tag for tag in self.run(run_id).tags if tag not in dropped])

    def cancel(self, run_id: int) -> RunDetail:
        return RunDetail.model_validate(self._call(routes.CANCEL_RUN, run_id=run_id))

    def config(self, run_id: int) -> dict[str, Any]:
        """The run's config with every default filled in, as the platform validated and stored it."""
        return self.run(run_id).config

    def clone(self, run_id: int, name: str | None = None, overrides: Mapping[str, Any] | None = None) -> CreatedRun:
        """Submit the run's config again under a new name, with `overrides` ({"parallel.tp": 2}) applied."""
        source = self.run(run_id)
        config = with_overrides(source.config, overrides or {})
        return self.submit(name or f"{source.name} (clone of run {run_id})", config)

    def events(self, run_id: int, after: int = 0, limit: int = EVENTS_PAGE) -> EventPage:
        """Events with seq > after, oldest first; `more` says the page is full."""
        return EventPage.model_validate(
            self._call(routes.RUN_EVENTS, query={"after": after, "limit": limit}, run_id=run_id)
        )

    def log(self, run_id: int, attempt: int, rank: int, lines: int = 200) -> LogTail:
        """The last lines a rank of an attempt printed, per file (stdout.log, stderr.log)."""
        answer = self._call(routes.RANK_LOG, query={"lines": lines}, run_id=run_id, number=attempt, rank=rank)
        return LogTail.model_validate(answer)

    def checkpoints(self, run_id: int) -> list[Checkpoint]:
        """Every checkpoint the run's attempts committed, oldest step first."""
        return [Checkpoint.model_validate(item) for item in self._call(routes.RUN_CHECKPOINTS, run_id=run_id)]

    def restore(
        self,
        run_id: int,
        checkpoint: int,
        *,
        fork: bool = False,
        parallel: Mapping[str, Any] | None = None,
        steps: int | None = None,
        name: str | None = None,
        lr: float | None = None,
        skip_steps: tuple[int, int] | None = None,
    ) -> Restored:
        """Resume from a committed checkpoint (its id): as the run's next attempt, or with `fork` as a new run;
        `parallel` fields change the layout, `steps` the last step, `lr` the peak learning rate, and
        `skip_steps` [first, last] leaves out the data of those steps."""
        body: dict[str, Any] = {"checkpoint": checkpoint, "mode": "fork" if fork else "attempt"}
        optional = {"parallel": parallel, "steps": steps, "name": name, "lr": lr, "skip_steps": skip_steps}
        body |= {field: value for field, value in optional.items() if value is not None}
        return Restored.model_validate(self._call(routes.RESTORE, body, run_id=run_id))

    def alerts(self, run_id: int, live_only: bool = False) -> list[Alert]:
        """The run's alerts, newest first; `live_only`: those open or acknowledged."""
        answer = self._call(routes.RUN_ALERTS, query={"state": "live" if live_only else "all"}, run_id=run_id)
        return [Alert.model_validate(alert) for alert in answer]

    # ---- live events ----

    def watch(self, run_id: int, after: int = 0, idle_s: float = 5.0) -> Iterator[list[Event]]:
        """The run's events with seq > after, in batches as they are stored, each once and in seq order.

        The websocket is best effort (a channel layer may drop a message), so the events API fills every gap,
        what was stored before the socket opened, and what a reconnect missed, as the run page does. After
        idle_s without an event it looks at the events API again and yields what it found, perhaps nothing:
        a caller gets its turn to look at the run. Leave the loop to stop watching."""
        cursor = after
        while True:
            with self._socket(run_id) as socket:
                batch, cursor = self.caught_up(run_id, cursor)
                if batch:
                    yield batch
                while True:
                    try:
                        message = json.loads(socket.recv(timeout=idle_s))
                    except TimeoutError:
                        batch, cursor = self.caught_up(run_id, cursor)
                        yield batch
                        continue
                    except ConnectionClosed:
                        break
                    pushed = [Event.model_validate(event) for event in message.get("events", [])]
                    pushed = [event for event in pushed if event.seq > cursor]
                    if not pushed:
                        continue
                    if pushed[0].seq != cursor + 1:
                        batch, cursor = self.caught_up(run_id, cursor)
                    else:
                        batch, cursor = pushed, pushed[-1].seq
                    yield batch
            # Closed by the platform (a restart, say): open another and fill what was missed from the events API.
            time.sleep(RECONNECT_PAUSE_S)

    def caught_up(self, run_id: int, cursor: int) -> tuple[list[Event], int]:
        """Every stored event with seq > cursor, page after page, and the new cursor."""
        events: list[Event] = []
        while True:
            page = self.events(run_id, after=cursor)
            events += page.events
            cursor = page.events[-1].seq if page.events else cursor
            if not page.more:
                return events, cursor

    def _socket(self, run_id: int) -> ClientConnection:
        address = urlsplit(self.url)
        scheme = "wss" if address.scheme == "https" else "ws"
        url = f"{scheme}://{address.netloc}{address.path}{routes.RUN_SOCKET.format(run_id=run_id)}"
        try:
            # The platform takes sockets only from its own origin (AllowedHostsOriginValidator).
            return connect(
                url,
                origin=f"{address.scheme}://{address.netloc}",
                additional_headers=self._auth_header,
                open_timeout=self.timeout,
            )
        except InvalidStatus as refused:
            status = refused.response.status_code
            why = "a bad token, a run that is not yours, or an origin the platform does not allow"
            raise ApiError(
                status, {"websocket": f"the platform refused the run's websocket: {why}"}, "GET", url
            ) from None
        except (OSError, TimeoutError) as error:
            raise Unreachable(f"cannot open the run's websocket at {url}: {error}") from error
