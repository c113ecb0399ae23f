"""Bounds on what one request may ask for.

Every bound here is one a hostile or careless client once used to exhaust a node: a 10 MB `name` field kept in
state on every node, a prompt of a million messages, a max_tokens that never ends. They are far above what a
real chat needs and small enough that a node refuses them in microseconds with a 422 naming the field.

Text that is not valid Unicode (JSON can spell a lone UTF-16 surrogate, `\\ud800`, that no UTF-8 encoder
accepts) is refused by pydantic itself for every `str` field with the error type below; the API answers it with
400 rather than 422, since the bytes, not a range, are wrong.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

MAX_MESSAGES = 2048
MAX_CONTENT_CHARS = 4 * 1024 * 1024  # one message's text; the body limit (8 MiB by default) is the outer bound
MAX_NAME_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 20  # no context is longer; a bigger budget is a typo or an attack
INVALID_UNICODE = "string_unicode"
"""pydantic's error type for a str that is not valid Unicode."""

ContentText = Annotated[str, Field(max_length=MAX_CONTENT_CHARS)]
NameText = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
ModelText = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_CHARS)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
