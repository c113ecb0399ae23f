"""The dashboard's HTTP side: index.html at `/`, hashed assets cached for good, the SPA fallback only for
unknown non-API pages that ask for HTML, and shipped modules that load nothing from outside the package."""

from __future__ import annotations

import re

from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from skulk.api.dashboard import CSP, IMMUTABLE, PAGE_PATHS, assets_version, install_dashboard, shipped_files
from skulk.api.errors import install_error_handlers
from skulk.api.security import Access, required_access
from skulk.dashboard import STATIC_DIR

HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    install_dashboard(app)
    api = APIRouter()

    @api.get("/models")
    async def models() -> dict[str, list[str]]:
        return {"data": []}

    @api.get("/v1/models")
    async def v1_models() -> dict[str, list[str]]:
        return {"data": []}

    app.include_router(api)
    return TestClient(app)


def test_index_mounts_on_root_with_versioned_assets_and_is_revalidated() -> None:
    reply = client().get("/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    assert 'id="root"' in reply.text and "%ASSETS%" not in reply.text
    assert f"/assets/{assets_version()}/js/main.js" in reply.text
    assert reply.headers["cache-control"] == "no-cache"
    assert reply.headers["content-security-policy"] == CSP


def test_assets_are_cached_for_good_with_their_media_type() -> None:
    web = client()
    reply = web.get(f"/assets/{assets_version()}/js/main.js")
    assert reply.status_code == 200 and reply.headers["cache-control"] == IMMUTABLE
    assert reply.headers["content-type"].startswith("text/javascript")
    assert web.get(f"/assets/{assets_version()}/app.css").headers["content-type"].startswith("text/css")


def test_unknown_versions_traversal_and_index_through_assets_are_404_in_the_api_shape() -> None:
    web = client()
    for path in (
        "/assets/0000000000000000/js/main.js",
        f"/assets/{assets_version()}/../__init__.py",
        f"/assets/{assets_version()}/%2e%2e/__init__.py",
        f"/assets/{assets_version()}/index.html",
        f"/assets/{assets_version()}/js/nothing.js",
    ):
        reply = web.get(path)
        assert reply.status_code == 404, path
        assert "error" in reply.json(), path


def test_spa_fallback_serves_pages_but_never_api_paths() -> None:
    web = client()
    for page in ("/chat", "/operator", "/placing", "/catalog", "/cluster/anything"):
        reply = web.get(page, headers=HTML)
        assert reply.status_code == 200 and 'id="root"' in reply.text, page
    assert web.get("/models", headers=HTML).json() == {"data": []}, "an API route stays the API"
    unknown_api = web.get("/v1/nothing", headers=HTML)
    assert unknown_api.status_code == 404 and "error" in unknown_api.json()
    assert web.get("/chat", headers={"Accept": "application/json"}).status_code == 404
    assert web.post("/chat", headers=HTML).status_code in (404, 405)


def test_shipped_modules_import_only_shipped_files_and_nothing_remote() -> None:
    imports = re.compile(r"""(?:import|from)\s*['"]([^'"]+)['"]""")
    for path in shipped_files():
        text = path.read_text()
        if path.suffix == ".js":
            for target in imports.findall(text):
                assert target.startswith("."), f"{path.name} imports {target}: bare or remote import"
                assert (path.parent / target).resolve().is_file(), f"{path.name} imports missing {target}"
        assert not re.search(r"""(src|href)=["']https?://""", text), f"{path.name} loads from the internet"
    index = (STATIC_DIR / "index.html").read_text()
    assert "http://" not in index and "https://" not in index


def test_the_dashboards_static_paths_need_no_key_and_its_pages_match_main_js() -> None:
    for path in ("/", f"/assets/{assets_version()}/js/main.js", *PAGE_PATHS):
        assert required_access("GET", path) is Access.NONE, path
    assert required_access("POST", "/chat") is Access.ADMIN
    assert required_access("GET", "/state") is Access.INFERENCE, "the data behind the page still needs a key"
    main_js = (STATIC_DIR / "js" / "main.js").read_text()
    routed = set(re.findall(r"path(?::| ===) '(/[a-z]+)'", main_js)) - {"/"}
    assert routed == set(PAGE_PATHS), "js/main.js PAGES and api/dashboard.py PAGE_PATHS disagree"
