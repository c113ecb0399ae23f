"""A local stand-in for the Hugging Face hub's file API, so download tests drive the real `huggingface_hub`
client (HF_ENDPOINT pointed here) without the internet.

It serves what the client asks for: model info (`/api/models/<id>[/revision/<rev>]`), the tree listing
(`/api/models/<id>/tree/<rev>`), and files (`HEAD`/`GET /<id>/resolve/<rev>/<file>`, with ETag, size,
commit headers and Range). Repositories are directories `<root>/<org>--<name>`; a `.gated` file inside
makes the repo gated (files need a bearer token). `--stall-after N` sends the first N bytes of a big file
and then hangs, so a test can kill the server mid-file; every request is appended to `<root>/requests.log`.
An endpoint `<url>/~<client>` is the same hub with its requests logged as `... @<client>`: one endpoint per node
tells which node fetched which file.
Run: python -m tests.fake_hub --root DIR --port P [--stall-after N]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 256 * 1024


def _repo_dir(root: Path, repo_id: str) -> Path | None:
    if ".." in repo_id or repo_id.count("/") != 1:
        return None
    path = root / repo_id.replace("/", "--")
    return path if path.is_dir() else None


def _files(repo: Path) -> list[Path]:
    return sorted(p for p in repo.rglob("*") if p.is_file() and not p.name.startswith("."))


def _oid(path: Path) -> str:
    return hashlib.sha1(f"{path.name}:{path.stat().st_size}".encode()).hexdigest()


def _missing(repo_id: str) -> JSONResponse:
    return JSONResponse({"error": f"Repository {repo_id} not found"}, 404, headers={"X-Error-Code": "RepoNotFound"})


def create_app(root: Path, stall_after: int | None) -> FastAPI:
    app = FastAPI()
    log = root / "requests.log"

    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]
        path, client = _untag(request.url.path)
        request.scope["path"] = path
        with log.open("a") as out:
            out.write(f"{request.method} {path} {request.headers.get('range', '-')}{f' @{client}' if client else ''}\n")
        return await call_next(request)

    @app.get("/api/models/{org}/{name}")
    @app.get("/api/models/{org}/{name}/revision/{rev}")
    async def info(org: str, name: str, rev: str = "main") -> Response:
        repo = _repo_dir(root, f"{org}/{name}")
        if repo is None:
            return _missing(f"{org}/{name}")
        siblings = [{"rfilename": str(p.relative_to(repo)), "size": p.stat().st_size} for p in _files(repo)]
        gated = "auto" if (repo / ".gated").exists() else False
        body = {
            "id": f"{org}/{name}",
            "modelId": f"{org}/{name}",
            "sha": COMMIT,
            "private": False,
            "gated": gated,
            "siblings": siblings,
            "tags": [],
            "downloads": 0,
            "likes": 0,
        }
        return JSONResponse(body)

    @app.get("/api/models/{org}/{name}/tree/{rev}")
    async def tree(org: str, name: str, rev: str) -> Response:
        repo = _repo_dir(root, f"{org}/{name}")
        if repo is None:
            return _missing(f"{org}/{name}")
        entries = [
            {"type": "file", "path": str(p.relative_to(repo)), "size": p.stat().st_size, "oid": _oid(p)}
            for p in _files(repo)
        ]
        return JSONResponse(entries)

    @app.api_route("/{org}/{name}/resolve/{rev}/{filename:path}", methods=["GET", "HEAD"])
    async def resolve(org: str, name: str, rev: str, filename: str, request: Request) -> Response:
        repo = _repo_dir(root, f"{org}/{name}")
        if repo is None:
            return _missing(f"{org}/{name}")
        if (repo / ".gated").exists() and not request.headers.get("authorization", "").startswith("Bearer "):
            return JSONResponse({"error": "gated"}, 401, headers={"X-Error-Code": "GatedRepo"})
        path = (repo / filename).resolve()
        if not path.is_file() or repo.resolve() not in path.parents:
            return JSONResponse({"error": "no entry"}, 404, headers={"X-Error-Code": "EntryNotFound"})
        size = path.stat().st_size
        headers = {"ETag": f'"{_oid(path)}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return Response(headers={**headers, "Content-Length": str(size)})
        start = _range_start(request.headers.get("range"))
        headers["Content-Length"] = str(size - start)
        status = 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
            status = 206
        return StreamingResponse(_body(path, start, stall_after), status, headers=headers)

    return app


def _untag(path: str) -> tuple[str, str | None]:
    """An endpoint of `<hub>/~<client>` serves as the hub itself and logs each request with `@<client>`, so a test
    giving each node its own endpoint tells which node fetched which file."""
    if not path.startswith("/~"):
        return path, None
    client, _, rest = path[2:].partition("/")
    return "/" + rest, client


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    return int(header[len("bytes=") :].split("-")[0] or 0)


async def _body(path: Path, start: int, stall_after: int | None) -> AsyncIterator[bytes]:
    sent = start
    with path.open("rb") as f:
        f.seek(start)
        while chunk := f.read(CHUNK):
            if stall_after is not None and sent + len(chunk) > stall_after:
                yield chunk[: max(stall_after - sent, 0)]
                await asyncio.sleep(3600)
            sent += len(chunk)
            yield chunk


def write_repo(root: Path, repo_id: str, files: dict[str, bytes | dict[str, object]], *, gated: bool = False) -> Path:
    """A repository directory under root; dict values are written as JSON."""
    repo = root / repo_id.replace("/", "--")
    repo.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        data = json.dumps(content).encode() if isinstance(content, dict) else content
        (repo / name).write_bytes(data)
    if gated:
        (repo / ".gated").write_text("")
    return repo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stall-after", type=int, default=None)
    args = parser.parse_args()
    uvicorn.run(create_app(args.root, args.stall_after), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()


class RunningHub:
    """The fake hub as a child process on a free loopback port: kill() it mid-file, start() it again."""

    def __init__(self, root: Path, stall_after: int | None = None) -> None:
        import socket

        self.root = root
        self.stall_after = stall_after
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, stall_after: int | None = None) -> RunningHub:
        import httpx

        cmd = [sys.executable, "-m", "tests.fake_hub", "--root", str(self.root), "--port", str(self.port)]
        if stall_after is not None:
            cmd += ["--stall-after", str(stall_after)]
        self.process = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/api/models/none/none", timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError("the fake hub did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def client_url(self, client: str) -> str:
        """This hub as one client's endpoint: its requests are logged with `@<client>`."""
        return f"{self.url}/~{client}"

    def requests(self) -> list[str]:
        log = self.root / "requests.log"
        return log.read_text().splitlines() if log.exists() else []


def write_random_model(
    root: Path, repo_id: str, *, shards: int = 1, hidden: int = 64, layers: int = 4, gated: bool = False
) -> Path:
    """A small random Llama (the demo generator's) as a hub repo; shards > 1 splits the weights by layer into
    model-0000i-of-0000n.safetensors with an index, as real checkpoints are."""
    from safetensors.torch import load_file, save_file

    from skulk.models.demo import generate_random_llama

    repo = root / repo_id.replace("/", "--")
    generate_random_llama(
        repo, hidden_size=hidden, n_layers=layers, n_heads=4, n_kv_heads=2, intermediate_size=hidden * 2, seed=7
    )
    if shards > 1:
        weights = load_file(str(repo / "model.safetensors"))
        (repo / "model.safetensors").unlink()
        names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        parts: list[dict[str, object]] = [{} for _ in names]
        weight_map = {}
        for tensor, value in weights.items():
            layer = int(tensor.split(".")[2]) if ".layers." in tensor else (0 if "embed" in tensor else layers - 1)
            which = min(layer * shards // layers, shards - 1)
            parts[which][tensor] = value
            weight_map[tensor] = names[which]
        for name, part in zip(names, parts, strict=True):
            save_file(part, str(repo / name), metadata={"format": "pt"})  # type: ignore[arg-type]
        total = sum((repo / n).stat().st_size for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    if gated:
        (repo / ".gated").write_text("")
    return repo


ALTERNATING_TEMPLATE = (  # Gemma's and Mistral's rule (their templates raise this message), over plain ChatML
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def set_chat_template(repo: Path, template: str) -> None:
    """Replace a model directory's chat template (tokenizer_config.json's chat_template)."""
    path = repo / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))


MISTRAL_TEMPLATE = (  # the tool parts of mistralai/Mistral-7B-Instruct-v0.3's template, its id check included
    "{%- set last = namespace(user=-1) %}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set last.user = loop.index0 %}{% endif %}{% endfor %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == last.user %}[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ message['content'] }}[/INST]"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '{"name": {{ call.function.name|tojson }}, "arguments": {{ call.function.arguments|tojson }}, '
    '"id": "{{ call.id }}"}{% if not loop.last %}, {% endif %}'
    "{%- endfor %}]{{ eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '[TOOL_RESULTS] {"content": {{ message["content"]|tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)
