"""The Confluent Schema Registry REST API over a :class:`~schemas.registry.SchemaRegistry` (FastAPI).

``tideline schemas serve`` runs :func:`create_app` with uvicorn, so that Confluent's
clients (``SchemaRegistryClient``, ``AvroSerializer``/``AvroDeserializer``, Kafka
Connect's converters, …) use Tideline's registry unchanged. Bodies are JSON, answered
as ``application/vnd.schemaregistry.v1+json``; requests may send that type,
``application/vnd.schemaregistry+json``, ``application/json`` or none.

=======  ==========================================  ==========================================
GET      /subjects                                   ``["orders-value", …]``
GET      /subjects/{s}/versions                      ``[1, 2]``
GET      /subjects/{s}/versions/{v}                  ``{"subject", "version", "id", "schema"}``;
                                                     v: a number, ``latest`` or -1
GET      /subjects/{s}/versions/{v}/schema           the schema itself
GET      /subjects/{s}/versions/{v}/referencedby     ``[]`` (Avro references are not supported)
POST     /subjects/{s}/versions                      register ``{"schema", "schemaType"?}`` → ``{"id"}``
POST     /subjects/{s}                               look up ``{"schema"}`` → as GET …/versions/{v}
GET      /schemas/ids/{id}                           ``{"schema"}``
GET      /schemas/ids/{id}/schema                    the schema itself
GET      /schemas/ids/{id}/subjects                  the subjects with a version of it
GET      /schemas/ids/{id}/versions                  ``[{"subject", "version"}]``
GET      /schemas/types                              ``["AVRO"]``
GET/PUT  /config                                     registry-wide level: GET ``{"compatibilityLevel"}``,
                                                     PUT ``{"compatibility"}``
DELETE   /config                                     back to the default level (``BACKWARD``)
GET/PUT  /config/{s}                                 a subject's level (GET: 40408 when it has
                                                     none, unless ``?defaultToGlobal=true``)
DELETE   /config/{s}                                 the subject back to the registry-wide level
POST     /compatibility/subjects/{s}/versions/{v}    ``{"is_compatible"}`` (+ ``"messages"`` with
                                                     ``?verbose=true``), against version v
POST     /compatibility/subjects/{s}/versions        the same, against the versions the level checks
GET      /mode, /mode/{s}                            ``{"mode": "READWRITE"}``
DELETE   /subjects/{s}[/versions/{v}]                405: the registry keeps every version
=======  ==========================================  ==========================================

Errors are Confluent's bodies ``{"error_code": <int>, "message": <str>}``: 40401 subject
not found, 40402 version not found, 40403 schema not found, 40408 no subject-level
compatibility, 409 incompatible schema (the message names every broken rule), 42201
invalid schema (also: a ``schemaType`` other than AVRO, schema references), 42202
invalid version, 42203 invalid compatibility level, 400 a body that is not JSON, 404 /
405 unknown path / method, 50001 the store failed (e.g. Kafka out of reach). Nothing is
written for a refused registration.

Thread-safety: handlers run in uvicorn's thread pool; the registry is thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.canonical import parse
from schemas.compat import CompatibilityLevel, check_compatibility
from schemas.errors import IncompatibleSchemaError, SchemaParseError
from schemas.registry import RegisteredSchema, SchemaRegistry

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
AVRO = "AVRO"
MAX_VERSION = 2**31 - 1

SUBJECT_NOT_FOUND = 40401
VERSION_NOT_FOUND = 40402
SCHEMA_NOT_FOUND = 40403
SUBJECT_LEVEL_NOT_CONFIGURED = 40408
INCOMPATIBLE_SCHEMA = 409
INVALID_SCHEMA = 42201
INVALID_VERSION = 42202
INVALID_COMPATIBILITY_LEVEL = 42203
STORE_ERROR = 50001


class RegistryHTTPError(Exception):
    """An answer in Confluent's error shape: HTTP ``status``, body ``{"error_code", "message"}``."""

    def __init__(self, status: int, error_code: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code
        self.message = message


def _json(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status_code=status, media_type=CONTENT_TYPE)


def _error(status: int, error_code: int, message: str) -> Response:
    return _json({"error_code": error_code, "message": message}, status)


def subject_not_found(subject: str) -> RegistryHTTPError:
    return RegistryHTTPError(404, SUBJECT_NOT_FOUND, f"Subject '{subject}' not found.")


def no_subject_level(subject: str) -> RegistryHTTPError:
    message = f"Subject '{subject}' does not have subject-level compatibility configured"
    return RegistryHTTPError(404, SUBJECT_LEVEL_NOT_CONFIGURED, message)


def schema_not_found(what: str = "Schema not found") -> RegistryHTTPError:
    return RegistryHTTPError(404, SCHEMA_NOT_FOUND, what)


def create_app(registry: SchemaRegistry, *, description: str = "") -> FastAPI:
    """The REST API of ``registry``; ``description`` (where the store is) goes into the request log lines."""
    app = FastAPI(title="Tideline schema registry", docs_url=None, redoc_url=None, openapi_url=None)
    _install_errors(app)
    _install_request_log(app, description)
    _subject_routes(app, registry)
    _schema_routes(app, registry)
    _config_routes(app, registry)
    _compatibility_routes(app, registry)
    return app


# ---------------------------------------------------------------------------- plumbing


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(RegistryHTTPError)
    async def registry_error(request: Request, exc: RegistryHTTPError) -> Response:
        return _error(exc.status, exc.error_code, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, exc.status_code, f"HTTP {exc.status_code} {exc.detail}")

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _error(422, 422, f"Unprocessable request: {problems}")

    @app.exception_handler(Exception)
    async def store_error(request: Request, exc: Exception) -> Response:
        log.error("schemas serve: %s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return _error(500, STORE_ERROR, f"Error in the backend data store: {first_line}")


def _install_request_log(app: FastAPI, description: str) -> None:
    """One logfmt line per request: method, path, status, milliseconds."""
    registry_field = f" registry={description}" if description else ""

    @app.middleware("http")
    async def request_line(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        elapsed_ms = (time.perf_counter() - started) * 1000
        log.info("schemas serve method=%s path=%s status=%d ms=%.1f%s", request.method, request.url.path,
                 response.status_code, elapsed_ms, registry_field)  # fmt: skip
        return response


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as e:
        raise RegistryHTTPError(400, 400, f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RegistryHTTPError(400, 400, "request body must be a JSON object")
    return body


def _schema_of(body: dict[str, Any]) -> str:
    """The Avro schema text of a register / lookup / compatibility request (42201 for anything else)."""
    schema_type = body.get("schemaType") or AVRO
    if str(schema_type).upper() != AVRO:
        message = f"Invalid schema: schemaType {schema_type} is not supported (Tideline registers AVRO)"
        raise RegistryHTTPError(422, INVALID_SCHEMA, message)
    if body.get("references"):
        raise RegistryHTTPError(422, INVALID_SCHEMA, "Invalid schema: schema references are not supported")
    schema = body.get("schema")
    if not isinstance(schema, str) or not schema.strip():
        raise RegistryHTTPError(422, INVALID_SCHEMA, "Invalid schema: empty schema")
    try:
        parse(schema)
    except SchemaParseError as e:
        raise RegistryHTTPError(422, INVALID_SCHEMA, f"Invalid schema: {e}") from None
    return schema


def _version_number(text: str) -> int | None:
    """``latest`` / -1 → None; n in [1, 2^31 − 1] → n; anything else → 42202."""
    if text == "latest" or text == "-1":
        return None
    if text.isdigit() and 1 <= int(text) <= MAX_VERSION:
        return int(text)
    raise RegistryHTTPError(422, INVALID_VERSION,
                            f"The specified version '{text}' is not a valid version id. Allowed values are between "
                            f'[1, 2^31-1] and the string "latest"')  # fmt: skip


def _version(registry: SchemaRegistry, subject: str, version_text: str) -> RegisteredSchema:
    number = _version_number(version_text)
    versions = registry.versions(subject)
    if not versions:
        raise subject_not_found(subject)
    if number is None:
        return registry.latest(subject)
    if number not in versions:
        raise RegistryHTTPError(404, VERSION_NOT_FOUND, f"Version {number} not found.")
    return registry.get_version(subject, number)


def _registered(found: RegisteredSchema) -> dict[str, Any]:
    return {"subject": found.subject, "version": found.version, "id": found.id, "schema": found.schema}


def _schema_id(text: str) -> int:
    if not text.isdigit():
        raise schema_not_found(f"Schema {text} not found")
    return int(text)


def _level(body: dict[str, Any]) -> CompatibilityLevel:
    try:
        return CompatibilityLevel.parse(str(body.get("compatibility", "")))
    except ValueError as e:
        raise RegistryHTTPError(422, INVALID_COMPATIBILITY_LEVEL, f"Invalid compatibility level: {e}") from None


# ---------------------------------------------------------------------------- /subjects


def _subject_routes(app: FastAPI, registry: SchemaRegistry) -> None:
    @app.get("/")
    def root() -> Response:
        return _json({})

    @app.get("/subjects")
    def subjects(subjectPrefix: str = "") -> Response:  # Confluent's parameter name
        return _json([s for s in registry.subjects() if s.startswith(subjectPrefix)])

    @app.get("/subjects/{subject}/versions")
    def versions(subject: str) -> Response:
        found = registry.versions(subject)
        if not found:
            raise subject_not_found(subject)
        return _json(found)

    @app.get("/subjects/{subject}/versions/{version}")
    def version(subject: str, version: str) -> Response:
        return _json(_registered(_version(registry, subject, version)))

    @app.get("/subjects/{subject}/versions/{version}/schema")
    def version_schema(subject: str, version: str) -> Response:
        return Response(_version(registry, subject, version).schema, media_type=CONTENT_TYPE)

    @app.get("/subjects/{subject}/versions/{version}/referencedby")
    def referenced_by(subject: str, version: str) -> Response:
        _version(registry, subject, version)
        return _json([])

    @app.post("/subjects/{subject}/versions")
    async def register(subject: str, request: Request) -> Response:
        schema = _schema_of(await _body(request))

        def write() -> Response:
            try:
                registered = registry.register(subject, schema)
            except IncompatibleSchemaError as e:
                details = [i.message for i in e.incompatibilities]
                raise RegistryHTTPError(409, INCOMPATIBLE_SCHEMA,
                                        f'Schema being registered is incompatible with an earlier schema for subject '
                                        f'"{subject}", details: {details}') from None  # fmt: skip
            return _json({"id": registered.id})

        return await run_in_threadpool(write)

    @app.post("/subjects/{subject}")
    async def lookup(subject: str, request: Request) -> Response:
        schema = _schema_of(await _body(request))

        def find() -> Response:
            if not registry.versions(subject):
                raise subject_not_found(subject)
            found = registry.lookup(subject, schema)
            if found is None:
                raise schema_not_found()
            return _json(_registered(found))

        return await run_in_threadpool(find)

    @app.delete("/subjects/{subject}")
    @app.delete("/subjects/{subject}/versions/{version}")
    def delete(subject: str, version: str = "") -> Response:
        raise RegistryHTTPError(405, 405, "HTTP 405 Method Not Allowed: deleting subjects or versions is not "
                                          "supported (Tideline's registry keeps every version)")  # fmt: skip


# ---------------------------------------------------------------------------- /schemas


def _schema_routes(app: FastAPI, registry: SchemaRegistry) -> None:
    def text_of(schema_id: str) -> tuple[int, str]:
        number = _schema_id(schema_id)
        try:
            return number, registry.schema_by_id(number)
        except LookupError:
            raise schema_not_found(f"Schema {number} not found") from None

    def versions_of(number: int) -> list[RegisteredSchema]:
        return [v for s in registry.subjects() for n in registry.versions(s)
                if (v := registry.get_version(s, n)).id == number]  # fmt: skip

    @app.get("/schemas/types")
    def types() -> Response:
        return _json([AVRO])

    @app.get("/schemas/ids/{schema_id}")
    def by_id(schema_id: str) -> Response:
        return _json({"schema": text_of(schema_id)[1]})

    @app.get("/schemas/ids/{schema_id}/schema")
    def raw_by_id(schema_id: str) -> Response:
        return Response(text_of(schema_id)[1], media_type=CONTENT_TYPE)

    @app.get("/schemas/ids/{schema_id}/subjects")
    def subjects_of(schema_id: str) -> Response:
        number, _ = text_of(schema_id)
        return _json(sorted({v.subject for v in versions_of(number)}))

    @app.get("/schemas/ids/{schema_id}/versions")
    def versions_by_id(schema_id: str) -> Response:
        number, _ = text_of(schema_id)
        return _json([{"subject": v.subject, "version": v.version} for v in versions_of(number)])

    @app.get("/mode")
    @app.get("/mode/{subject}")
    def mode(subject: str = "") -> Response:
        return _json({"mode": "READWRITE"})


# ---------------------------------------------------------------------------- /config


def _config_routes(app: FastAPI, registry: SchemaRegistry) -> None:
    @app.get("/config")
    def registry_level() -> Response:
        return _json({"compatibilityLevel": registry.compatibility(None).value})

    @app.put("/config")
    async def set_registry_level(request: Request) -> Response:
        level = _level(await _body(request))
        await run_in_threadpool(registry.set_compatibility, None, level)
        return _json({"compatibility": level.value})

    @app.delete("/config")
    def reset_registry_level() -> Response:
        before = registry.compatibility(None)
        registry.set_compatibility(None, None)
        return _json({"compatibilityLevel": before.value})

    @app.get("/config/{subject}")
    def subject_level(subject: str, defaultToGlobal: bool = False) -> Response:  # Confluent's parameter name
        own = registry.configured_compatibility(subject)
        if own is None and not defaultToGlobal:
            raise no_subject_level(subject)
        return _json({"compatibilityLevel": (own or registry.compatibility(None)).value})

    @app.put("/config/{subject}")
    async def set_subject_level(subject: str, request: Request) -> Response:
        level = _level(await _body(request))
        await run_in_threadpool(registry.set_compatibility, subject, level)
        return _json({"compatibility": level.value})

    @app.delete("/config/{subject}")
    def reset_subject_level(subject: str) -> Response:
        own = registry.configured_compatibility(subject)
        if own is None:
            raise no_subject_level(subject)
        registry.set_compatibility(subject, None)
        return _json({"compatibilityLevel": own.value})


# ---------------------------------------------------------------------------- /compatibility


def _compatibility_routes(app: FastAPI, registry: SchemaRegistry) -> None:
    def answer(messages: list[str], verbose: bool) -> Response:
        body: dict[str, Any] = {"is_compatible": not messages}
        if verbose:
            body["messages"] = messages
        return _json(body)

    @app.post("/compatibility/subjects/{subject}/versions/{version}")
    async def against_version(subject: str, version: str, request: Request, verbose: bool = False) -> Response:
        schema = _schema_of(await _body(request))

        def check() -> Response:
            existing = _version(registry, subject, version)
            level = registry.compatibility(subject)
            found = check_compatibility(level, parse(schema), [parse(existing.schema)], first_version=existing.version)
            return answer([i.message for i in found], verbose)

        return await run_in_threadpool(check)

    @app.post("/compatibility/subjects/{subject}/versions")
    async def against_subject(subject: str, request: Request, verbose: bool = False) -> Response:
        schema = _schema_of(await _body(request))
        report = await run_in_threadpool(registry.check, subject, schema)
        return answer([i.message for i in report.incompatibilities], verbose)
