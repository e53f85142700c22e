"""The one error type media preprocessing raises: it names the content part at fault."""


class MediaError(ValueError):
    """Refused media. ``part`` is e.g. ``"image 2"`` (1-based, in request order).

    A ValueError, because SGLang's OpenAI layer answers ValueErrors raised while tokenizing a
    request with HTTP 400 and keeps serving.
    """

    def __init__(self, part: str, reason: str):
        super().__init__(f"{part}: {reason}")
        self.part = part
        self.reason = reason
