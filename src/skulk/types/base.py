"""Wire conventions: camelCase keys out, snake_case or camelCase in, tagged unions as {"Variant": {...}}."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    """Every wire type: frozen, strict about unknown keys, camelCase on the wire."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
        serialize_by_alias=True,
    )


class TaggedModel(CamelModel):
    """A variant of a tagged union, written as {"ClassName": {fields}} so clients can switch on the key."""

    @model_serializer(mode="wrap")
    def _wrap_in_tag(self, handler: Any) -> dict[str, Any]:
        return {type(self).__name__: handler(self)}

    @model_validator(mode="before")
    @classmethod
    def _unwrap_tag(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) == 1:
            ((key, inner),) = data.items()
            if key == cls.__name__ and isinstance(inner, dict):
                return inner
        return data


def tag_of(value: Any) -> str:
    """The discriminator for a tagged union: the single key of a dict, or the class name of a model."""
    if isinstance(value, dict):
        return next(iter(value), "")
    return type(value).__name__
