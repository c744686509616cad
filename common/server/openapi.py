"""OpenAPI 3.1 documents generated from the msgspec types the servers validate with.

Each app lists its routes as `ApiRoute`s (request type, response types by status); the
schemas come from msgspec.json.schema_components, so the document cannot drift from the
types. `mount_openapi` serves it at /openapi.json and a Swagger UI page at /docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from common.server.generate_response import ErrorResponse

REF = "#/components/schemas/{name}"
ERROR_STATUSES = {"400": "invalid request (the message names the field)", "413": "body too large",
                  "415": "not JSON", "503": "not ready or overloaded"}


@dataclass(frozen=True)
class ApiRoute:
    method: str
    path: str
    summary: str
    request: Any = None  # a msgspec type, or None (no body)
    responses: dict[str, Any] = field(default_factory=dict)  # status -> type (None: no JSON schema)
    streams: bool = False  # 200 may also be text/event-stream (request "stream": true)
    media_type: str = "application/json"  # of the 200 answer
    errors: bool = True  # the error statuses above apply


def openapi_document(title: str, routes: list[ApiRoute], version: str = "0.1.0") -> dict[str, Any]:
    types = [r.request for r in routes if r.request is not None]
    types += [t for r in routes for t in r.responses.values() if t is not None]
    types.append(ErrorResponse)
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    by_type = dict(zip(types, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        op: dict[str, Any] = {"summary": r.summary, "operationId": _operation_id(r), "responses": {}}
        if r.request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": by_type[r.request]}}}
        for status, rtype in r.responses.items():
            content: dict[str, Any] = {}
            if rtype is not None:
                content[r.media_type] = {"schema": by_type[rtype]}
            elif r.media_type != "application/json":
                content[r.media_type] = {"schema": {"type": "string"}}
            if r.streams and status == "200":
                content["text/event-stream"] = {"schema": {"type": "string"}}
            op["responses"][status] = {"description": "OK" if status == "200" else status, "content": content}
        if r.errors:
            for status, text in ERROR_STATUSES.items():
                op["responses"].setdefault(status, {
                    "description": text, "content": {"application/json": {"schema": by_type[ErrorResponse]}}})
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components}}


def mount_openapi(app: FastAPI, document: dict[str, Any], *, docs: bool = True) -> None:
    """/openapi.json, and with `docs` the Swagger UI at /docs (its script comes from cdn.jsdelivr.net)."""
    body = msgspec.json.encode(document)
    title = document["info"]["title"]

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> Response:
        return Response(body, media_type="application/json")

    if not docs:
        return

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{title} - API")


def _operation_id(r: ApiRoute) -> str:
    return r.method.lower() + r.path.replace("/", "_").replace("-", "_")
