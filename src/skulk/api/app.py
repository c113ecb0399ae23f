"""The FastAPI application of one node."""

from __future__ import annotations

from fastapi import FastAPI

from skulk import __version__
from skulk.api.admin import admin_router
from skulk.api.claude import claude_router
from skulk.api.config_routes import config_router
from skulk.api.control import control_router
from skulk.api.dashboard import install_dashboard
from skulk.api.diagnostics import DiagnosticsHandle, diagnostics_router
from skulk.api.embeddings import embeddings_router
from skulk.api.errors import install_error_handlers
from skulk.api.events import events_router
from skulk.api.meta_instances import meta_instances_router
from skulk.api.models import models_router
from skulk.api.ollama import ollama_router
from skulk.api.openai import openai_router
from skulk.api.responses import responses_router
from skulk.api.security import install_security
from skulk.api.state_routes import state_router
from skulk.api.store import store_router
from skulk.api.tracing import tracing_router
from skulk.config import Settings
from skulk.store.service import ModelFiles


def create_app(node: DiagnosticsHandle) -> FastAPI:
    app = FastAPI(title="Skulk", version=__version__)
    install_error_handlers(app)
    install_dashboard(app)  # before security, so its Host and key checks wrap the dashboard too
    settings = getattr(node, "settings", None)
    if isinstance(settings, Settings):
        install_security(app, settings)
    routers = (state_router(node), control_router(node), meta_instances_router(node), openai_router(node),
               diagnostics_router(node), config_router(node))
    for router in routers:
        app.include_router(router)
    for router in (claude_router(node), ollama_router(node), responses_router(node), embeddings_router(node)):
        app.include_router(router)
    if hasattr(node, "event_log"):
        app.include_router(events_router(node))  # type: ignore[arg-type]
    if hasattr(node, "traces"):
        app.include_router(tracing_router(node))  # type: ignore[arg-type]
    if hasattr(node, "restart"):
        app.include_router(admin_router(node))  # type: ignore[arg-type]
    files = getattr(node, "files", None)
    app.include_router(models_router(node, files if isinstance(files, ModelFiles) else None))
    if isinstance(files, ModelFiles):
        app.include_router(store_router(node, files))
    return app
