"""A chat message's content parts (OpenAI's ``text`` and ``image_url`` parts) in edgespec's terms.

The text parts are joined in order; each ``image_url`` part leaves an ``<image>`` mark where it
stood and adds its image to the request's images, in order (the vision-language target's
processor puts the image's tokens at the mark: ``edgespec.models.vision``). An image travels
inline, as a ``data:`` URL (``data:image/png;base64,...``): a remote URL (``https://...``) is
refused, since the server fetches nothing. Whether the bytes are an image, and not too large,
is checked at admission (``edgespec.models.images``); a text-only target refuses images there.
"""

from __future__ import annotations

import base64
import binascii
import re

from edgespec.models.images import MAX_IMAGE_BYTES

from .api_errors import ApiError

IMAGE_MARK = "<image>"  # the processor's image mark (SmolVLM / Idefics3)
DETAILS = (None, "auto", "low", "high")  # OpenAI's detail hint: accepted, not used


def openai_param(path: str) -> str:
    """``messages[0].content[1].text`` as OpenAI's errors name a parameter:
    ``messages.[0].content.[1].text`` (the messages say the first form)."""
    return re.sub(r"(?<!\.)\[", ".[", path)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", openai_param(param))


def image_from_url(url: object, param: str) -> bytes:
    """The image file a ``data:`` URL holds (base64), or the ApiError that says why not."""
    if not isinstance(url, str) or not url:
        raise _bad(f"'{param}' must be a data: URL string", param)
    head, comma, payload = url.partition(",")
    if not head.lower().startswith("data:"):
        scheme = head.split(":", 1)[0][:20] if ":" in head else ""
        what = f"a {scheme} URL" if scheme else "a URL without the data: scheme"
        raise ApiError(400, f"'{param}' is {what}: remote image URLs are refused (this server "
                            "fetches nothing); send the image inline as a data: URL, "
                            "data:image/png;base64,...", "invalid_request_error",
                       openai_param(param), "image_url_not_inline")
    media, _, encoding = head[5:].partition(";")
    if not comma or encoding.lower() != "base64":
        raise _bad(f"'{param}' must be a base64 data: URL (data:image/png;base64,...)", param)
    if media and not media.lower().startswith("image/"):
        raise _bad(f"'{param}' holds {media[:40]!r}, not an image", param)
    if len(payload) > (MAX_IMAGE_BYTES // 3 + 1) * 4 + 4:  # before decoding it
        raise _bad(f"the image at '{param}' is over {MAX_IMAGE_BYTES} bytes, the most a "
                   "request's images may hold", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"'{param}' is not valid base64", param) from None


def parts_content(i: int, parts: list, images: list[bytes]) -> str:
    """Message ``i``'s content parts as text with an ``<image>`` mark per image part; the images
    are appended to ``images``."""
    text: list[str] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind in PART_FIELDS:  # a part's other fields, refused by name (null aside)
            _only_fields(part, PART_FIELDS[kind], where)
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _bad(f"'{where}.text' must be a string", f"{where}.text")
            text.append(part["text"])
        elif kind == "image_url":
            spec = part.get("image_url")
            if isinstance(spec, dict):
                _only_fields(spec, ("url", "detail"), f"{where}.image_url")
                if spec.get("detail") not in DETAILS:
                    raise _bad(f"'{where}.image_url.detail' must be auto, low or high",
                               f"{where}.image_url.detail")
                spec = spec.get("url")
            images.append(image_from_url(spec, f"{where}.image_url.url"))
            text.append(IMAGE_MARK)
        elif not isinstance(part, dict) or "type" not in part:
            raise _bad(f"'{where}' must be an object with a 'type' (text or image_url)",
                       where)
        else:
            raise _bad(f"'{where}' is a {str(kind)[:40]!r} part: the content parts taken are "
                       "text and image_url", f"{where}.type")
    return "".join(text)


PART_FIELDS = {"text": ("type", "text"), "image_url": ("type", "image_url")}


def _only_fields(obj: dict, known: tuple[str, ...], where: str) -> None:
    """Refuse, by name, a field of ``obj`` other than ``known`` that is not null."""
    for key, value in obj.items():
        if key not in known and value is not None:
            name = f"{where}.{str(key)[:40]}"  # the client's key as it wrote it
            raise ApiError(400, f"'{name}' is not supported", "invalid_request_error",
                           f"{openai_param(where)}.{str(key)[:40]}")
