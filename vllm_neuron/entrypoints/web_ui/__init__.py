"""The web page in the server: `GET /` a chat playground and `GET /dashboard` a live view of /metrics.

The pages are static files of this package (static/: HTML, CSS and framework-free ES modules; no CDN, no build
step), read once when the app is built. Each page gets a `<base href>` of the --root-path, so that every URL
it uses (its assets, /v1, /metrics) goes through the proxy's prefix. The pages and their assets are public;
the API calls they make carry the key the page asks for, so every API route stays as guarded as without the
page. A strict Content-Security-Policy (scripts and styles from the server only, nothing inline) backs up the
rule the page's code keeps: model output is only ever set as text, never parsed as HTML.

With the web UI on, a path no route knows outside the API's /v1 and /v2 gets an HTML 404 page (a person
typed it into a browser); API paths keep the OpenAI error object. `--disable-webui` leaves all of this out.
"""
from __future__ import annotations

import html
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

STATIC_DIR = Path(__file__).parent / "static"
ASSET_PREFIX = "/ui/"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
NOT_FOUND_PAGE = "404.html"
HEAD_FRAGMENT = "head.html"  # what every page's <head> shares, in place of its {{HEAD}}; not served itself
# Unknown paths here are API calls gone wrong: their clients read the OpenAI error object.
API_PREFIXES = ("/v1", "/v2")
_ROOT_PLACEHOLDER = "{{ROOT}}"
_HEAD_PLACEHOLDER = "{{HEAD}}"
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                  ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                           "connect-src 'self'; base-uri 'self'; form-action 'none'; frame-ancestors 'none'")
# Pages are small and change with the package: always revalidated.
_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}


def is_public_path(path: str) -> bool:
    """The web UI's pages and assets: open to a browser without the API key (--api-key-all-routes included)."""
    return path in PAGES or path.startswith(ASSET_PREFIX)


def is_api_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in API_PREFIXES)


def _route_path(request: Request) -> str:
    path, root = request.url.path, request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def load_assets() -> dict[str, tuple[bytes, str]]:
    """static/'s files by name -> (bytes, content type); only the kinds listed in _CONTENT_TYPES."""
    assets = {}
    for file in sorted(STATIC_DIR.iterdir()):
        kind = _CONTENT_TYPES.get(file.suffix)
        if file.is_file() and kind is not None:
            assets[file.name] = (file.read_bytes(), kind)
    missing = [name for name in (*PAGES.values(), NOT_FOUND_PAGE, HEAD_FRAGMENT) if name not in assets]
    if missing:
        raise RuntimeError(f"the web UI's files {missing} are missing from {STATIC_DIR} (a broken install)")
    return assets


def install_web_ui(app: FastAPI, root_path: str = "") -> None:
    """Adds the pages, their assets and the HTML 404 to `app`; after install_exception_handlers (it wraps the
    JSON handler of HTTP errors)."""
    assets = load_assets()
    head = assets[HEAD_FRAGMENT][0].decode("utf-8").replace(_ROOT_PLACEHOLDER, html.escape(root_path + "/"))
    pages = {name: assets[name][0].decode("utf-8").replace(_HEAD_PLACEHOLDER, head.rstrip("\n"))
             for name in (*PAGES.values(), NOT_FOUND_PAGE)}

    def page(name: str, status_code: int = 200) -> HTMLResponse:
        return HTMLResponse(pages[name], status_code=status_code, headers=_HEADERS)

    def page_route(name: str):
        async def route() -> HTMLResponse:
            return page(name)
        return route

    for path, name in PAGES.items():
        app.add_api_route(path, page_route(name), methods=["GET"], include_in_schema=False)

    @app.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets or name.endswith(".html"):
            raise StarletteHTTPException(404)
        body, kind = assets[name]
        return Response(body, media_type=kind, headers=_HEADERS)

    json_handler = app.exception_handlers[StarletteHTTPException]

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404 and not is_api_path(_route_path(request)):
            return page(NOT_FOUND_PAGE, 404)
        return await json_handler(request, exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
