"""The FastAPI application of one node: every router, the error boundary and the security middleware, always."""

from __future__ import annotations

from fastapi import FastAPI

from skulk import __version__
from skulk.api.admin import admin_router
from skulk.api.claude import claude_router
from skulk.api.config_routes import config_router
from skulk.api.control import control_router
from skulk.api.dashboard import install_dashboard
from skulk.api.diagnostics import diagnostics_router
from skulk.api.embeddings import embeddings_router
from skulk.api.errors import install_error_handlers
from skulk.api.events import events_router
from skulk.api.meta_instances import meta_instances_router
from skulk.api.metrics import metrics_router
from skulk.api.models import models_router
from skulk.api.ollama import ollama_router
from skulk.api.openai import openai_router
from skulk.api.openapi import declare_common_errors
from skulk.api.responses import responses_router
from skulk.api.security import install_security, sealing_router
from skulk.api.services import ApiServices
from skulk.api.serving_metrics import RequestCountMiddleware
from skulk.api.state_routes import state_router
from skulk.api.store import store_router
from skulk.api.tracing import tracing_router


def create_app(services: ApiServices) -> FastAPI:
    """The same app on every node and in every test: what a node lacks (an event log that is off, a runner it
    does not run) its route answers as a typed error, never a missing route or a missing check."""
    app = FastAPI(title="Skulk", version=__version__)
    install_error_handlers(app)
    install_dashboard(app)  # before security, so its Host and key checks wrap the dashboard too
    install_security(app, services.settings)
    settings = services.settings
    for router in (state_router(services), control_router(services), meta_instances_router(services),
                   openai_router(services), diagnostics_router(services), config_router(services),
                   claude_router(services), ollama_router(services), responses_router(services),
                   embeddings_router(services), events_router(services), tracing_router(services),
                   admin_router(services), models_router(services), metrics_router(services), store_router(services),
                   sealing_router(services.sealer, settings.api_host, settings.zenoh_listen, services.members)):
        app.include_router(declare_common_errors(router))
    app.add_middleware(RequestCountMiddleware, metrics=services.serving)  # outermost: refusals count too
    return app
