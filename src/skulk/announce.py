"""The lines a node prints when its API listens: the readiness marker and a first command that works as
printed (pure, so each start-up mode is tested)."""

from __future__ import annotations

from skulk.config import Settings

QUESTION = "What is the capital of France? Answer in one word."


def try_line(settings: Settings, port: int) -> str:
    """A curl that answers as printed: the default model's chat when it is placed, else how to place one;
    with API keys, the Authorization header (the key itself comes from the operator's environment, never the
    log)."""
    auth = " -H \"Authorization: Bearer $SKULK_API_KEY\"" if settings.api_keys or settings.admin_keys else ""
    base, dashboard = f"localhost:{port}", f"http://localhost:{port}/"
    if settings.tls_cert is not None:  # curl trusts the node's certificate (self-signed: its own CA)
        auth, base = f" --cacert {settings.tls_ca or settings.tls_cert}{auth}", f"https://localhost:{port}"
        dashboard = f"{base}/"
    if not settings.place_default:
        return (f"Try: curl{auth} {base}/v1/models  (nothing is placed: --no-place-default; place a "
                f"model in the dashboard at {dashboard} or with POST /place_instance)")
    body = (f'{{"model":"{settings.default_model}","messages":[{{"role":"user","content":"{QUESTION}"}}],'
            f'"temperature":0,"max_tokens":24}}')
    return f"Try: curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{body}'"
