"""Why the discovery service refused or could not answer a request, each with the HTTP status it maps to.

The same errors reach MCP callers as a tool error carrying the message; ``code`` is the machine-readable word in an
HTTP error body (``{"error": {"code", "message"}}``).
"""

from __future__ import annotations

from tooltrie.errors import TooltrieError


class ServeError(TooltrieError):
    """Base class of the service's errors."""

    status = 500
    code = "internal"


class InvalidRequestError(ServeError, ValueError):
    """The request is well-formed JSON but asks for something impossible (k out of range, empty query, ...)."""

    status = 422
    code = "invalid_request"


class UnknownRegistryError(ServeError, LookupError):
    """The request names a registry this server does not serve."""

    status = 404
    code = "unknown_registry"


class UnauthorizedError(ServeError, PermissionError):
    """No API key, or one the policy does not know (answered with ``WWW-Authenticate: Bearer``). The message never
    quotes the key."""

    status = 401
    code = "unauthorized"

    def __init__(self, message: str, *, invalid_token: bool = False) -> None:
        super().__init__(message)
        self.invalid_token = invalid_token  # a key was sent but is not valid (RFC 6750's error="invalid_token")

    @property
    def challenge(self) -> str:
        return 'Bearer realm="tooltrie"' + (', error="invalid_token"' if self.invalid_token else "")


class ForbiddenError(ServeError, PermissionError):
    """The tenant may not do this: use a registry outside its policy, or reload one without ``admin``."""

    status = 403
    code = "forbidden"


class RegistryChangedError(ServeError):
    """The registry was reloaded while the request was decoding and the answer no longer fits the caller's policy
    under the new version; it is withheld. Retrying gets an answer from the new version."""

    status = 409
    code = "registry_changed"


class RegistryReloadError(ServeError, ValueError):
    """A reload found the registry file unreadable or uncompilable; the previous version keeps serving."""

    status = 422
    code = "invalid_registry"


class QueueFullError(ServeError):
    """Every decoding slot is taken and the queue is full: try again after ``retry_after_s``."""

    status = 429
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(ServeError):
    """No answer within the server's timeout; the request was cancelled and its slot freed."""

    status = 504
    code = "timeout"


class UpstreamError(ServeError):
    """A failure of the vLLM server the endpoint answers through (``serve --vllm-url``). Its message says only the
    kind of failure and ``request_id``; the details (the server's address, its answer, the error's text) are in the
    endpoint's log under the same id, never in what a client reads."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class UpstreamTimeoutError(UpstreamError, RequestTimeoutError):
    """The vLLM server the endpoint answers through (``serve --vllm-url``) did not answer in time."""

    code = "upstream_timeout"


class BadGatewayError(UpstreamError):
    """The vLLM server the endpoint answers through cannot be reached, refused the request, or answered something
    that is not k tools of the registry."""

    status = 502
    code = "bad_gateway"


class ClientGoneError(ServeError):
    """The client disconnected before its answer; the request was cancelled (499: nobody reads the reply)."""

    status = 499
    code = "client_closed_request"


class DecodingFailedError(ServeError, RuntimeError):
    """The engine failed while decoding (a bug, not bad input): the rows of that step get this, the engine is
    rebuilt, and the server goes on."""

    status = 500
    code = "decoding_failed"


class UnavailableError(ServeError):
    """The service is stopping, or its health probe failed."""

    status = 503
    code = "unavailable"


class WarmingError(UnavailableError):
    """The server is still making a registry's prior (its tools embedded and indexed): ready in ``retry_after_s``,
    about (``/healthz`` says "warming" meanwhile)."""

    code = "warming"

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
