from ninja import NinjaAPI

from loom.alerts.api import router as alerts_router
from loom.checkpoints.api import router as checkpoints_router
from loom.planner.api import router as planner_router
from loom.runs.api import router as runs_router
from loom.runs.nodes_api import router as nodes_router
from loom.telemetry.api import router as telemetry_router

from .auth import docs_access, user_auth
from .renderer import FastJSONRenderer

api = NinjaAPI(
    title="loom",
    version="1",
    auth=user_auth,
    urls_namespace="api",
    docs_decorator=docs_access,
    renderer=FastJSONRenderer(),
)
api.add_router("/", runs_router)
api.add_router("/", nodes_router)
api.add_router("/", telemetry_router)
api.add_router("/", checkpoints_router)
api.add_router("/", alerts_router)
api.add_router("/plan/", planner_router)
