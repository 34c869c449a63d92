"""How the API answers what goes wrong: bad input as 400 {"errors": {field: message}} naming the field,
whoever refused it (the JSON parser, ninja's schema of the request, a service); a missing object as 404
in the same shape; anything unforeseen as a logged traceback and a 500 JSON answer, never a page of HTML.
A refusal that names no field of the request names what it is about: "authorization" (401), "csrf" (403),
"run" (a state conflict, 409), "backend" (503)."""

import json
import logging
import math
import unicodedata
from typing import Annotated

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from ninja import NinjaAPI, Schema
from ninja.errors import HttpError, ValidationError
from ninja.parser import Parser
from pydantic import AfterValidator, ConfigDict

from trainer.config import STRICT_TYPE_MESSAGES

# A path or query parameter arrives as text: what it failed to read as, in the words of the config's errors.
TYPE_MESSAGES = {
    **STRICT_TYPE_MESSAGES,
    "int_parsing": STRICT_TYPE_MESSAGES["int_type"],
    "float_parsing": STRICT_TYPE_MESSAGES["float_type"],
    "bool_parsing": STRICT_TYPE_MESSAGES["bool_type"],
}

UNAUTHORIZED = "send a valid API token (Authorization: Bearer <token>) or log in"

# Where Django itself logs a failed request: settings.LOGGING sends it to stderr whatever DEBUG says.
request_log = logging.getLogger("django.request")


class FieldErrors(Schema):
    errors: dict[str, str]


class Body(Schema):
    """A request body: a field the operation does not know is refused by name, not ignored."""

    model_config = ConfigDict(extra="forbid")


def _printable(text: str) -> str:
    # NUL ends a string in C and PostgreSQL refuses it; other control characters hide in logs and pages.
    if any(unicodedata.category(char) == "Cc" for char in text):
        raise ValueError("must not contain control characters (NUL, tab, newline, escape, …)")
    return text


def _no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("must not contain a NUL character")
    return text


# A name someone types: a run's, a fork's, a token's.
Name = Annotated[str, AfterValidator(_printable)]
# Free text (a reason): lines are fine, NUL is not (PostgreSQL cannot store it).
Text = Annotated[str, AfterValidator(_no_nul)]


class NonFiniteNumbers(ValueError):
    """NaN or Infinity in a body: Python's parser takes them, RFC 8259 has no such numbers and no field means one."""

    def __init__(self, paths: list[str]):
        super().__init__(", ".join(paths))
        self.paths = paths


class StrictJSONParser(Parser):
    def parse_querydict(self, data, list_fields, request):
        refused = [
            {"loc": ("query", key), "msg": "must not contain a NUL character", "type": "value_error"}
            for key, values in data.lists()
            if any("\x00" in value for value in values)
        ]
        if refused:
            raise ValidationError(refused)
        return super().parse_querydict(data, list_fields, request)

    def parse_body(self, request):
        document = json.loads(request.body)
        paths = [".".join(map(str, path)) or "body" for path in _non_finite_paths(document, ())]
        if paths:
            raise NonFiniteNumbers(paths)
        return document


def _non_finite_paths(value, path: tuple):
    if isinstance(value, float) and not math.isfinite(value):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite_paths(item, (*path, index))


def field_key(loc: tuple) -> str:
    """("body", "body", "config") → "config"; ("query", "limit") → "limit"; the whole body → "body"."""
    source, *rest = loc
    if source == "body":
        rest = rest[1:]
    return ".".join(str(part) for part in rest) or source


def request_field_errors(errors: list[dict]) -> dict[str, str]:
    answer: dict[str, str] = {}
    for error in errors:
        kind = error["type"]
        if kind == "extra_forbidden":
            message = "is not a known field"
        elif kind == "missing":
            message = "is required"
        else:
            message = TYPE_MESSAGES.get(kind, error["msg"].removeprefix("Value error, "))
        answer.setdefault(field_key(tuple(error["loc"])), message)
    return answer


def install(api: NinjaAPI) -> None:
    """Answer every error of `api` as this module says."""

    def invalid_request(request, exc: ValidationError):
        return api.create_response(request, {"errors": request_field_errors(exc.errors)}, status=400)

    def http_error(request, exc: HttpError):
        if exc.status_code == 401:
            return api.create_response(request, {"errors": {"authorization": UNAUTHORIZED}}, status=401)
        if exc.status_code == 403:
            return api.create_response(request, {"errors": {"csrf": str(exc)}}, status=403)
        cause = exc.__cause__
        if isinstance(cause, NonFiniteNumbers):
            # Keyed as the body's fields are: "config.optimizer.grad_clip".
            fields = {path: "must be a finite number (JSON has no NaN or Infinity)" for path in cause.paths}
            return api.create_response(request, {"errors": fields}, status=400)
        if cause is not None:
            # ninja's "Cannot parse request body": the parser's own words say where.
            message = f"must be a JSON document: {cause}"
            return api.create_response(request, {"errors": {"body": message}}, status=exc.status_code)
        key = "url" if exc.status_code == 404 else "request"
        return api.create_response(request, {"errors": {key: str(exc)}}, status=exc.status_code)

    def too_large(request, exc: RequestDataTooBig):
        message = f"is larger than the {settings.DATA_UPLOAD_MAX_MEMORY_SIZE:,} bytes the server takes"
        return api.create_response(request, {"errors": {"body": message}}, status=413)

    def not_found(request, exc: Http404):
        return api.create_response(request, {"errors": {"url": str(exc) or "not found"}}, status=404)

    def unhandled(request, exc: Exception):
        request_log.error("Internal Server Error: %s", request.path, exc_info=exc, extra={"status_code": 500})
        message = "the server failed to answer; the error is in its log"
        response = api.create_response(request, {"errors": {"server": message}}, status=500)
        # Logged above with its traceback; Django would log the 500 again without one.
        response._has_been_logged = True
        return response

    api.add_exception_handler(ValidationError, invalid_request)
    api.add_exception_handler(HttpError, http_error)
    api.add_exception_handler(RequestDataTooBig, too_large)
    api.add_exception_handler(Http404, not_found)
    api.add_exception_handler(Exception, unhandled)


def _has_path_parameters(operation: dict) -> bool:
    return any(parameter.get("in") == "path" for parameter in operation.get("parameters", []))


def document_errors(schema: dict) -> dict:
    """Add to every operation of an OpenAPI document the error answers it can give and does not say yet."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (FieldErrors,):
        components.setdefault(model.__name__, model.model_json_schema(ref_template="#/components/schemas/{model}"))

    def answer(model, description: str) -> dict:
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        return {"description": description, "content": {"application/json": {"schema": ref}}}

    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            # ninja keys responses by int status; JSON writes both kinds of key as the same string.
            responses = {str(status): documented for status, documented in operation.get("responses", {}).items()}
            if operation.get("parameters") or "requestBody" in operation:
                responses.setdefault("400", answer(FieldErrors, "Bad input, one message per field"))
            if "requestBody" in operation:
                responses.setdefault("413", answer(FieldErrors, "The body is larger than the server takes"))
            if operation.get("security"):
                responses.setdefault("401", answer(FieldErrors, "No valid token or session"))
                responses.setdefault("403", answer(FieldErrors, "A session's request without its CSRF token"))
            if _has_path_parameters(operation):
                responses.setdefault("404", answer(FieldErrors, "Nothing of yours at this URL"))
            responses.setdefault("500", answer(FieldErrors, "The server failed; the traceback is in its log"))
            operation["responses"] = responses
    return schema
