"""Bounds on what one request may ask for.

Every bound here is one a hostile or careless client once used to exhaust a node: a 10 MB `name` field kept in
state on every node, a prompt of a million messages, a max_tokens that never ends. They are far above what a
real chat needs and small enough that a node refuses them in microseconds with a 422 naming the field.

Text that is not valid Unicode (JSON can spell a lone UTF-16 surrogate, `\\ud800`, that no UTF-8 encoder
accepts) is refused by pydantic itself for every `str` field with the error type below; the API answers it with
400 rather than 422, since the bytes, not a range, are wrong.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field
from pydantic_core import PydanticCustomError

MAX_MESSAGES = 2048
MAX_CONTENT_CHARS = 4 * 1024 * 1024  # one message's text; the body limit (8 MiB by default) is the outer bound
MAX_NAME_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_STOP_CHARS = 256
MAX_IMAGE_URL_CHARS = 32 * 1024 * 1024  # a data: URL of formats/images.MAX_IMAGE_BYTES in base64, and its header
MAX_TOKENS_LIMIT = 1 << 20  # no context is longer; a bigger budget is a typo or an attack
INVALID_UNICODE = "string_unicode"
"""pydantic's error type for a str that is not valid Unicode."""

ContentText = Annotated[str, Field(max_length=MAX_CONTENT_CHARS)]
NameText = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
ModelText = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_CHARS)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

MEDIA_PREFIXES = ("image", "input_image", "input_audio", "audio", "input_file", "file", "document", "video")
TEXT_ONLY = "text_only"
"""The error type of a content part a text model cannot read (an image, audio, a file): every API answers it with
one 400 that says so, in its own error shape, instead of the union's list of what else the part could have been."""


def refuse_media(content: Any, text_kinds: frozenset[str]) -> Any:
    """A `mode="before"` validator for a content list: any part whose `type` is not one of `text_kinds` (an
    `image_url`, `input_image`, `image`, `input_audio`, `file`, ...) raises TEXT_ONLY before the union is tried."""
    if isinstance(content, list):
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in text_kinds and kind.startswith(MEDIA_PREFIXES):
                raise PydanticCustomError(
                    TEXT_ONLY,
                    "this model takes text only: content part {index} is of type '{kind}'; send text parts only",
                    {"index": index, "kind": kind})
    return content
