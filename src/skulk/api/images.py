"""The API node's check of a chat request's images, before any runner is asked.

Every API turns its images into OpenAI image parts (Anthropic's base64 `image` blocks and Ollama's `images` as
data: URLs), so one check serves them all, and its ApiError is answered in each API's own error shape:
- a model whose card has no vision (or no card: the model is not served) answers `text_only`, as before images
  were read at all;
- too many images, a URL that is not data: or an allowed file:// (http(s) above all: never fetched), bytes over
  the bound, or bytes that are no image, answer a 400 `invalid_request` saying which part and why
  (formats/images.py has the bounds);
- a file:// image is read here and sent on as data, so the runner's node needs no access to the directory.
"""

from __future__ import annotations

from skulk.api.services import ApiServices
from skulk.formats.images import MAX_IMAGES, ImageRefused, check_image
from skulk.state.queries import card_of
from skulk.types.chat import ChatCompletionRequest, ChatMessage, ImagePart, ImageUrl
from skulk.types.errors import ApiError, ErrorCode


def image_parts(request: ChatCompletionRequest) -> list[tuple[int, int]]:
    """(message, part) of every image part, in order."""
    return [(i, j) for i, m in enumerate(request.messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if isinstance(part, ImagePart)]


def checked_images(node: ApiServices, request: ChatCompletionRequest) -> ChatCompletionRequest:
    """The request with every image checked and carried as a data: URL; ApiError (400) as the module says."""
    found = image_parts(request)
    if not found:
        return request
    card = card_of(node.state, request.model)
    if card is None or not card.vision:
        i, j = found[0]
        raise ApiError(ErrorCode.text_only, f"messages.{i}.content: this model takes text only: content part {j} is "
                                            "of type 'image_url'; send text parts only")
    if len(found) > MAX_IMAGES:
        raise ApiError(ErrorCode.invalid_request, f"{len(found)} images: at most {MAX_IMAGES} a request")
    messages = list(request.messages)
    for i, j in found:
        messages[i] = _with_checked(node, messages[i], i, j)
    return request.model_copy(update={"messages": messages})


def _with_checked(node: ApiServices, message: ChatMessage, i: int, j: int) -> ChatMessage:
    assert isinstance(message.content, list)
    part = message.content[j]
    assert isinstance(part, ImagePart)
    try:
        url = check_image(part.image_url.url, node.settings.image_dir)
    except ImageRefused as exc:
        raise ApiError(ErrorCode.invalid_request, f"messages.{i}.content.{j}: {exc}") from None
    content = list(message.content)
    content[j] = ImagePart(type="image_url", image_url=ImageUrl(url=url))
    return message.model_copy(update={"content": content})
