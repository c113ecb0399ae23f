"""The error vocabulary: every code has its status, and each API's wire shape is written at one boundary."""

from __future__ import annotations

import json

import pytest

from skulk.api.errors import claude_error, ollama_error, openai_error
from skulk.types import placement
from skulk.types.chunks import ErrorChunk
from skulk.types.errors import HTTP_STATUS, ApiError, ErrorCode, kind_for
from skulk.types.ids import CommandId


def test_every_code_has_one_status() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert all(100 <= status < 600 for status in HTTP_STATUS.values())


def test_each_placement_refusal_is_a_code_with_its_own_status() -> None:
    base = placement.PlacementError
    refusals = [c for c in vars(placement).values() if isinstance(c, type) and issubclass(c, base) and c is not base]
    assert len(refusals) >= 8
    for refusal in refusals:
        code = ErrorCode(refusal.__name__)
        assert code.status == refusal.model_fields["http_status"].default, refusal.__name__


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
     (404, "not_found_error"), (413, "invalid_request_error"), (422, "invalid_request_error"),
     (429, "rate_limit_error"), (500, "server_error"), (502, "server_error"), (503, "service_unavailable"),
     (504, "server_error")],
)
def test_openai_error_type_by_status(status: int, kind: str) -> None:
    assert kind_for(status) == kind


# (error, OpenAI body, Claude body, Ollama body): the bytes each API has always answered.
CASES = [
    (ApiError(ErrorCode.model_not_found, "No instance found for model m"), 404,
     b'{"error":{"message":"No instance found for model m","type":"not_found_error","code":"model_not_found"}}',
     b'{"type":"error","error":{"type":"not_found_error","message":"No instance found for model m"}}',
     b'{"error":"No instance found for model m"}'),
    (ApiError(ErrorCode.invalid_request, "top_k: too big", status=422), 422,
     b'{"error":{"message":"top_k: too big","type":"invalid_request_error","code":"invalid_request"}}',
     b'{"type":"error","error":{"type":"invalid_request_error","message":"top_k: too big"}}',
     b'{"error":"top_k: too big"}'),
    (ApiError(ErrorCode.instance_not_ready, "loading"), 503,
     b'{"error":{"message":"loading","type":"service_unavailable","code":"instance_not_ready"}}',
     b'{"type":"error","error":{"type":"overloaded_error","message":"loading"}}',
     b'{"error":"loading"}'),
    (ApiError(ErrorCode.InsufficientMemory, "needs 2.00 GB"), 400,
     b'{"error":{"message":"needs 2.00 GB","type":"invalid_request_error","code":"InsufficientMemory"}}',
     b'{"type":"error","error":{"type":"invalid_request_error","message":"needs 2.00 GB"}}',
     b'{"error":"needs 2.00 GB"}'),
    (ApiError(ErrorCode.internal_error, "boom"), 500,
     b'{"error":{"message":"boom","type":"server_error","code":"internal_error"}}',
     b'{"type":"error","error":{"type":"api_error","message":"boom"}}',
     b'{"error":"boom"}'),
]


@pytest.mark.parametrize(("error", "status", "openai", "claude", "ollama"), CASES)
def test_each_api_writes_its_own_shape(error: ApiError, status: int, openai: bytes, claude: bytes,
                                       ollama: bytes) -> None:
    for translate, body in ((openai_error, openai), (claude_error, claude), (ollama_error, ollama)):
        response = translate(error)
        assert response.status_code == status
        assert json.loads(response.body) == json.loads(body)
        assert response.body == json.dumps(json.loads(body), separators=(",", ":")).encode()


def test_an_error_chunk_takes_its_codes_status_unless_given() -> None:
    assert ErrorChunk(command_id=CommandId("c"), message="m", code=ErrorCode.session_changed).status == 503
    assert ErrorChunk(command_id=CommandId("c"), message="m").status == 500
    given = ErrorChunk(command_id=CommandId("c"), message="m", code=ErrorCode.timeout, status=503)
    assert given.status == 503
    read_back = ErrorChunk.model_validate_json(given.model_dump_json())
    assert read_back == given and read_back.code is ErrorCode.timeout


def test_a_lone_surrogate_in_a_message_is_escaped() -> None:
    assert ApiError(ErrorCode.invalid_request, "bad \ud800").message == "bad \\ud800"
