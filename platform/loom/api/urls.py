from ninja import NinjaAPI

from loom.accounts.api import router as accounts_router
from loom.alerts.api import router as alerts_router
from loom.checkpoints.api import router as checkpoints_router
from loom.datasets.api import router as datasets_router
from loom.planner.api import router as planner_router
from loom.runs.api import router as runs_router
from loom.runs.nodes_api import router as nodes_router
from loom.telemetry.api import router as telemetry_router

from . import errors
from .auth import docs_access, user_auth
from .renderer import FastJSONRenderer


class LoomAPI(NinjaAPI):
    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        """The contract names every answer an operation can give, errors included."""
        return errors.document_errors(super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params))


api = LoomAPI(
    title="loom",
    version="1",
    auth=user_auth,
    urls_namespace="api",
    docs_decorator=docs_access,
    renderer=FastJSONRenderer(),
    parser=errors.StrictJSONParser(),
)
errors.install(api)
api.add_router("/", runs_router)
api.add_router("/", nodes_router)
api.add_router("/", telemetry_router)
api.add_router("/", checkpoints_router)
api.add_router("/", alerts_router)
api.add_router("/", accounts_router)
api.add_router("/", datasets_router)
api.add_router("/plan/", planner_router)
