"""The dashboard's HTTP routes (outside `/v1/` and outside the OpenAPI document).

Routes:

* `GET /dashboard`: the page (static HTML). With `?key=K` it stores K in the dashboard's cookie and
  redirects to `/dashboard`, so the key leaves the address bar; `?key=` (empty) forgets it.
* `GET /dashboard/state`: a snapshot as JSON, of what the caller's key may see.
* `GET /dashboard/events`: `text/event-stream`; a `snapshot` event, then updates (`replica`,
  `replica_removed`, `coordinator`, `round`, `adapter`, `adapter_removed`), each a JSON object with
  `now_unix_s`, and keep-alive comments in silences.

The API key is taken, in this order, from `Authorization: Bearer`, the `key` query parameter and the
`collm_dashboard_key` cookie (HttpOnly, SameSite=Strict, path `/dashboard`): a browser's EventSource
cannot send headers, so the page relies on the cookie. Keys are checked as on `/v1/` (auth.py: 401
missing or unknown, 429 rate limit); an open gateway, or an admin key, sees everything; a tenant's key
sees its own and the shared adapters, their versions and rounds, and no cluster view. A stream is
authorized when it opens (a revoked key's open stream runs until it reconnects). The key is never
logged, and these routes are not traced (their URLs may carry it).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from collm_gateway.api.deps import StateDep
from collm_gateway.auth import Principal, bearer_token, unauthenticated
from collm_gateway.dashboard.hub import DashboardHub
from collm_gateway.dashboard.state import Viewer

if TYPE_CHECKING:
    from collm_gateway.app import GatewayState

router = APIRouter(include_in_schema=False)

PAGE_PATH = "/dashboard"
KEY_PARAM = "key"
KEY_COOKIE = "collm_dashboard_key"

# The page loads nothing from elsewhere: inline script and style, its own origin for data.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
NO_STORE = {"Cache-Control": "no-store"}


@cache
def page_html() -> str:
    return resources.files("collm_gateway.dashboard").joinpath("static/index.html").read_text("utf-8")


def presented_key(request: Request) -> str | None:
    """The API key of a dashboard request: bearer header, then `?key=`, then the dashboard cookie."""
    return (
        bearer_token(request.headers.get("authorization"))
        or request.query_params.get(KEY_PARAM)
        or request.cookies.get(KEY_COOKIE)
        or None
    )


def viewer_of(principal: Principal) -> Viewer:
    """An open gateway or an admin key sees everything; a tenant's key its adapters and no cluster."""
    everything = principal.open_access or principal.is_admin
    return Viewer(cluster=everything, all_adapters=everything, tenant=principal.tenant)


def _viewer(request: Request, state: GatewayState) -> Viewer:
    key = presented_key(request)
    if key is None and state.auth.keys_required:
        raise unauthenticated(
            "this dashboard needs an API key: enter it on the page, open /dashboard?key=<key> (kept in a "
            "cookie), or send 'Authorization: Bearer <key>'"
        )
    return viewer_of(state.auth.authenticate(key))


def _hub(state: GatewayState) -> DashboardHub:
    assert state.dashboard is not None
    return state.dashboard


@router.get(PAGE_PATH)
async def page(request: Request) -> Response:
    key = request.query_params.get(KEY_PARAM)
    if key is None:
        return HTMLResponse(page_html(), headers=PAGE_HEADERS)
    resp = RedirectResponse(PAGE_PATH, status_code=303, headers=NO_STORE)
    if key:
        resp.set_cookie(KEY_COOKIE, key, path=PAGE_PATH, httponly=True, samesite="strict")
    else:
        resp.delete_cookie(KEY_COOKIE, path=PAGE_PATH, httponly=True, samesite="strict")
    return resp


@router.get(PAGE_PATH + "/state")
async def dashboard_state(request: Request, state: StateDep) -> JSONResponse:
    viewer = _viewer(request, state)
    return JSONResponse(await _hub(state).snapshot(viewer), headers=NO_STORE)


@router.get(PAGE_PATH + "/events")
async def dashboard_events(request: Request, state: StateDep) -> StreamingResponse:
    viewer = _viewer(request, state)
    hub = _hub(state)
    client = await hub.connect(viewer)
    return StreamingResponse(
        hub.events(client),
        media_type="text/event-stream",
        headers={**NO_STORE, "X-Accel-Buffering": "no"},
    )
