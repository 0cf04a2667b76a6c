"""The admin API's interactive docs, offline: the OpenAPI schema (FastAPI's 422s described
as the 400s this API answers) and Swagger UI from the ``swagger-ui-bundle`` package's files,
behind the token like the API (AdminGuard also lets the docs' Basic password and session
cookie in; see :mod:`ingest.admin`)."""

from __future__ import annotations

import html
from pathlib import Path as FilePath
from typing import Any

import orjson
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from ingest.admin.deps import operator

# Swagger UI's files served to /admin/docs (from the swagger-ui-bundle package).
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png")


def _docs_assets() -> FilePath | None:
    try:
        # Lazy: an optional package; without it only the schema is served.
        import swagger_ui_bundle  # type: ignore[import-untyped]  # noqa: PLC0415 (optional package, see above)
    except ImportError:
        return None
    return FilePath(swagger_ui_bundle.swagger_ui_path)


def add_docs(app: FastAPI) -> None:
    """The schema and Swagger UI from local files, behind the token (no CDN, no public page).
    Without the swagger-ui-bundle package only the schema is served."""
    docs = [Depends(operator)]  # AdminGuard asked for the token (Basic, for a browser)
    assets = _docs_assets()

    @app.get("/openapi.json", include_in_schema=False, dependencies=docs)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    if assets is None:
        return

    @app.get("/docs", include_in_schema=False, dependencies=docs)
    def swagger(request: Request) -> HTMLResponse:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        return HTMLResponse(_swagger_page(root, f"{app.title}: docs"))

    @app.get("/docs/assets/{name}", include_in_schema=False, dependencies=docs)
    def swagger_asset(name: str) -> FileResponse:
        if name not in DOCS_ASSETS:
            raise HTTPException(404, "not found")
        return FileResponse(assets / name)


def _swagger_page(root: str, title: str) -> str:
    """Swagger UI's page. The schema's URL is made from ``location.origin``, which never holds
    credentials: a page opened as ``http://user:TOKEN@host/...`` resolves a relative URL to
    one that does, and browsers refuse to fetch that ("Failed to load API definition"). The
    fetch is authenticated by the session cookie the page's answer set."""
    schema = orjson.dumps(f"{root}/openapi.json").decode().replace("</", "<\\/")
    assets = html.escape(f"{root}/docs/assets")
    return f"""<!DOCTYPE html>
<html>
<head>
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link type="text/css" rel="stylesheet" href="{assets}/swagger-ui.css">
<link rel="shortcut icon" href="{assets}/favicon-32x32.png">
<title>{html.escape(title)}</title>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script>
const ui = SwaggerUIBundle({{
    url: window.location.origin + {schema},
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}})
</script>
</body>
</html>
"""


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, with FastAPI's generated 422 responses described as the 400s
    this API answers instead."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            openapi_version=app.openapi_version,
            description=app.description,
            routes=app.routes,
        )
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses.setdefault(
                        "400",
                        {
                            "description": "Bad input (the field is named).",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ErrorOut"}
                                }
                            },
                        },
                    )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema
