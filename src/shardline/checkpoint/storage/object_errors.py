"""How an object store's errors read: the store refusing a conditional request, and an error's first line for a
one-line message.
"""

from __future__ import annotations

__all__ = ["first_line", "precondition_failed"]


def precondition_failed(error: BaseException) -> bool:
    """Whether ``error`` is the store refusing a conditional request (HTTP 412; s3fs turns it into an OSError)."""
    seen: BaseException | None = error
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                return True
        if "pre-condition" in str(seen).lower() or "precondition" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its class name if it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
