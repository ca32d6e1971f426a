"""Remote locations and what a failed request to a store means, decided in one place.

Two layers reach remote files: :mod:`olmax.store` (run directories in buckets: whole objects,
listings, conditional writes) and :mod:`olmax.data.remote` (token files and checkpoints read in
place: sizes and ranged reads). Every command that reads remotely goes through one of them, and
both send each request through :func:`retried` and read its failure with :func:`final_error`,
so a failure means one thing everywhere:

- **a location that looks like a URL but is not one** (``s3:/bucket/x``, ``gs:x``, ``hdfs://x``,
  a bucket name no store accepts, an HTTP port out of range) is a ConfigError before any request
  (:func:`url_scheme`); so is **an endpoint variable that is not a URL** (``AWS_ENDPOINT_URL``,
  ``AWS_ENDPOINT_URL_S3``, ``STORAGE_EMULATOR_HOST``: :func:`check_endpoints`) and a client that
  cannot be configured (no credentials or region where the client needs them);
- **what a retry cannot cure** is one OlmaxError at once (exit 2) naming the URL: a missing object
  (:class:`NotFound`, which ``exists`` checks ask for), a missing bucket, a denied request (HTTP
  401/403), another 4xx;
- **what a retry may cure** (a dropped, refused or timed-out connection, a host that cannot be
  resolved, HTTP 5xx, 408, 425, 429, a short answer) is retried ``ATTEMPTS`` times with back-off
  from ``BACKOFF_S`` doubling up to ``MAX_BACKOFF_S``; after the last try it is a
  :class:`~olmax.errors.RestartableError` (exit 75) naming the URL, what failed and the cause
  (``connection refused (HOST:PORT)``, ``HTTP 503 Service Unavailable``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from olmax.errors import ConfigError, OlmaxError, RestartableError

log = logging.getLogger(__name__)

ATTEMPTS = 5
BACKOFF_S = 0.25
MAX_BACKOFF_S = 4.0
RETRY_STATUS = (408, 425, 429, 500, 502, 503, 504)
# The schemes olmax reads (gcs:// is gs://); run directories live in s3:// and gs:// only.
SCHEMES = ("s3", "gs", "gcs", "http", "https")
BUCKET_SCHEMES = ("s3", "gs", "gcs")
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]")
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST")

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------
# Locations


_URL_LIKE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.S)


def url_scheme(location: Any, what: str = "") -> str | None:
    """The scheme (lower case, ``gcs`` as ``gs``) of a location that is a URL; None for a local
    path (one with a colon in it too: ``runs/a:b``, ``run:1``). Text that looks like a URL but is
    not one is a ConfigError naming ``what`` (the setting) and the text: a known scheme without
    ``//`` (``s3:/b/x``, ``gs:x``), an unknown scheme with it (``hdfs://x``), no bucket name (or
    one with characters no store allows), an HTTP address without a host or with a bad port.
    Run directories check their bucket name fully (:func:`olmax.store.bucket_path`)."""
    text = os.fspath(location) if isinstance(location, os.PathLike) else location
    if not isinstance(text, str):
        return None
    m = _URL_LIKE.fullmatch(text)
    if m is None:
        return None
    scheme, rest = m.group(1).lower(), m.group(2)
    at = f"{what} {text}" if what else text
    if not rest.startswith("//"):
        if scheme in SCHEMES:
            raise ConfigError(f"{at}: not a URL ({scheme}: is followed by '//': "
                              f"{_example(scheme)}); a local path with a colon is written "
                              f"./{text}")
        return None
    if scheme not in SCHEMES:
        raise ConfigError(f"{at}: unknown scheme {scheme}:// (olmax reads s3://, gs://, http:// and "
                          f"https://; a local path is written without a scheme)")
    netloc = rest[2:].split("/", 1)[0]
    if scheme in BUCKET_SCHEMES:
        if not netloc or any(c.isspace() or c in "\\?#@:" for c in netloc):
            raise ConfigError(f"{at}: {netloc!r} is not a bucket name (expected "
                              f"{_example(scheme)})")
        return "gs" if scheme == "gcs" else scheme
    problem = _http_problem(text)
    if problem:
        raise ConfigError(f"{at}: {problem} (expected {_example(scheme)})")
    return scheme


def _example(scheme: str) -> str:
    return f"{scheme}://BUCKET/PATH" if scheme in BUCKET_SCHEMES else f"{scheme}://HOST[:PORT]/PATH"


def _http_problem(url: str) -> str | None:
    """What is wrong with an http(s) address, or None."""
    if any(c.isspace() for c in url):
        return "a URL holds no spaces"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{e}"
    if not parts.hostname:
        return "no host"
    if port is not None and not 0 < port < 65536:
        return f"port {port} is out of range"
    return None


def is_url(location: Any, what: str = "") -> bool:
    """Whether ``location`` is a URL of a scheme olmax reads (see :func:`url_scheme`, whose
    ConfigError a malformed one raises)."""
    return url_scheme(location, what) is not None


def check_location(location: Any, what: str) -> None:
    """A setting's location, checked where it is declared: a URL olmax reads or a local path
    (:func:`url_scheme` decides; a malformed one is a ConfigError naming ``what``)."""
    url_scheme(location, what)


# ----------------------------------------------------------------------------------------------
# Endpoints and clients


def check_endpoints(scheme: str | None = None) -> None:
    """The endpoint variables of ``scheme``'s clients (all of them when None) hold URLs: an
    S3-compatible store's ``http(s)://HOST[:PORT]``, a Cloud Storage emulator's ``HOST:PORT`` or
    URL. Anything else is a ConfigError naming the variable, before any request."""
    names = {"s3": ENDPOINT_VARIABLES[:2], "gs": ENDPOINT_VARIABLES[2:]}.get(
        "gs" if scheme == "gcs" else str(scheme), ENDPOINT_VARIABLES if scheme is None else ())
    for name in names:
        value = os.environ.get(name)
        if not value:
            continue
        url = value if "://" in value or name != "STORAGE_EMULATOR_HOST" else f"http://{value}"
        parts_scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        problem = (_http_problem(url) if parts_scheme in ("http", "https")
                   else "not an http:// or https:// URL")
        if problem:
            form = "HOST:PORT or http://HOST:PORT" if name == "STORAGE_EMULATOR_HOST" else \
                "http(s)://HOST[:PORT]"
            raise ConfigError(f"{name}={value!r}: {problem} (expected {form})")


# Client errors that say the client is not set up (credentials, region, endpoint): no retry helps.
_SETUP_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "NoRegionError",
                 "InvalidRegionError", "InvalidEndpointConfigurationError", "ProfileNotFound",
                 "DefaultCredentialsError", "RefreshError", "UnknownSignatureVersionError")


def _setup_problem(e: BaseException) -> str | None:
    for x in chain(e):
        if type(x).__name__ in _SETUP_ERRORS:
            return _short(x)
        if (isinstance(x, ValueError) and type(x).__module__.startswith("botocore")) or \
                str(x).startswith(("Invalid endpoint:", "Provided region_name")):
            return _short(x)
    return None


def _credentials_hint(url: str) -> str:
    return ("the AWS_* variables or profile" if url.lower().startswith("s3") else
            "the application-default credentials (GOOGLE_APPLICATION_CREDENTIALS)")


# ----------------------------------------------------------------------------------------------
# Failures


class NotFound(OlmaxError):
    """A missing object or file at ``url`` (exit 2): ``exists`` checks catch this, and only this."""

    def __init__(self, url: str, noun: str = "file") -> None:
        super().__init__(f"{noun} not found: {url}")
        self.url = url


def chain(e: BaseException | None) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (or during), outermost first."""
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
        if isinstance(e, OlmaxError):   # an earlier failure this one was raised while handling
            break                       # (already olmax's own words), not its cause
    return out


def http_status(e: BaseException) -> int | None:
    """The HTTP status a client library's exception carries (aiohttp, gcsfs, botocore)."""
    for x in chain(e):
        code = None
        if hasattr(x, "request_info"):                  # aiohttp's ClientResponseError
            code = getattr(x, "status", None)
        elif type(x).__name__ == "HttpError":           # gcsfs
            code = getattr(x, "code", None)
        elif isinstance(getattr(x, "response", None), dict):   # botocore's ClientError
            code = getattr(x, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int) and 100 <= code <= 599:
            return code
    return None


def error_code(e: BaseException) -> str:
    """botocore's error code (``NoSuchBucket``, ``AccessDenied``) or the words of the error."""
    for x in chain(e):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict) and resp.get("Error", {}).get("Code"):
            return str(resp["Error"]["Code"])
    return " ".join(str(x) for x in chain(e))


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:200]


def short_error(e: BaseException) -> str:
    """``Type: first line`` of an exception."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def connection_trouble(e: BaseException) -> bool:
    """A dropped, refused or timed-out connection (or a host that cannot be resolved) somewhere
    in ``e``'s chain: what a retry may cure."""
    return any(isinstance(x, (ConnectionError, TimeoutError)) or
               (type(x).__module__.startswith(("aiohttp", "botocore", "urllib3")) and
                any(w in type(x).__name__ for w in ("Connect", "Disconnected", "Timeout",
                                                    "Payload", "Endpoint")))
               for x in chain(e))


def cause(e: BaseException) -> str:
    """What went wrong, in a few words: ``HTTP 503 Service Unavailable``, ``connection refused
    (HOST:PORT)``, else the innermost error's first words."""
    code = http_status(e)
    links = chain(e)
    if code is not None:
        reason = next((str(getattr(x, "message", "")) for x in links
                       if getattr(x, "status", None) == code and getattr(x, "message", None)), "")
        return f"HTTP {code} {reason}".strip()
    if any(isinstance(x, ConnectionRefusedError) or getattr(x, "errno", None) == errno.ECONNREFUSED
           or "Connect call failed" in str(x) for x in links):
        at = next((f" ({getattr(x, 'host', '')}:{getattr(x, 'port', '')})" for x in links
                   if isinstance(getattr(x, "host", None), str) and getattr(x, "port", None)), "")
        m = None if at else re.search(r"\('([^']+)', (\d+)\)", " ".join(map(str, links)))
        return "connection refused" + (at or (f" ({m.group(1)}:{m.group(2)})" if m else ""))
    return _short(links[-1])


def _denial(e: BaseException) -> str:
    """The store's words for a denied request: gcsfs's ``Forbidden: URL`` line left out (the
    endpoint's upload address, not the object), the message's first sentence kept."""
    text = str(e)
    if text.startswith("Forbidden: ") and "\n" in text:
        text = text.split("\n", 1)[1].split(". ", 1)[0] or text
    return _short(ValueError(text))


def past_end(e: BaseException) -> bool:
    """A ranged request the store refused as past the end of the object (HTTP 416; S3's
    ``InvalidRange``): the object is shorter than its listed size."""
    return any(getattr(x, "status", None) == 416 or "InvalidRange" in str(x) or " 416" in str(x)
               for x in chain(e))


def final_error(url: str, e: BaseException, noun: str = "file") -> OlmaxError | None:
    """The one line for what a retry cannot cure, else None (retried). See the module notes;
    ``noun`` names what a missing object was (``token file``, ``checkpoint file``)."""
    if isinstance(e, OlmaxError):
        return e
    if isinstance(e, ConfigError):
        return OlmaxError(str(e))
    setup = _setup_problem(e)
    if setup is not None:
        return OlmaxError(f"{url}: the client cannot be set up ({setup}); check "
                          f"{_credentials_hint(url)} and {', '.join(ENDPOINT_VARIABLES)}")
    code, words = http_status(e), error_code(e)
    scheme = url.split("://", 1)[0].lower()
    if scheme in BUCKET_SCHEMES and ("NoSuchBucket" in words or "bucket does not exist" in
                                     words.lower() or "specified bucket is not valid" in words.lower()):
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        return OlmaxError(f"{url}: bucket {scheme}://{bucket} not found")
    if code in (401, 403) or (isinstance(e, PermissionError) and not connection_trouble(e)) \
            or "AccessDenied" in words or (scheme in BUCKET_SCHEMES and "Forbidden" in words):
        if scheme in BUCKET_SCHEMES:
            bucket = url.split("://", 1)[1].split("/", 1)[0]
            return OlmaxError(f"{url}: access to bucket {scheme}://{bucket} denied "
                              f"({_denial(chain(e)[-1])}); check {_credentials_hint(url)}")
        return OlmaxError(f"{url}: access denied ({cause(e)})")
    if code in (404, 410) or "NoSuchKey" in words or (
            isinstance(e, FileNotFoundError) and code is None and not connection_trouble(e)):
        return NotFound(url, noun)
    if code is not None and code < 500 and code not in RETRY_STATUS and code != 416:
        return OlmaxError(f"{url}: the store refused the request ({cause(e)})")
    return None


class Retry(Exception):
    """An attempt's failure that a retry may cure, described by the attempt itself: the ``url``
    it failed on, what failed (for the log), the cause, and whether the file looks shorter than
    its listed size (then the last failure is an input error: the file is truncated)."""

    def __init__(self, url: str, failed: str, why: str, *, truncated: bool = False,
                 detail: str | None = None) -> None:
        super().__init__(why)
        self.url, self.failed, self.cause, self.truncated = url, failed, why, truncated
        self.detail = why if detail is None else detail   # what the "truncated" error quotes


def retried(url: str, what: str, attempt: Callable[[], T], *, quiet: bool = False,
            noun: str = "file", passthrough: Callable[[BaseException], bool] | None = None,
            truncated: Callable[[BaseException], bool] | None = None) -> T:
    """``attempt()``, retried as the module notes say. An attempt fails by raising a client
    library's error about ``url`` (:func:`final_error` decides whether a retry may cure it), an
    OlmaxError (raised at once) or a :class:`Retry` it describes itself. ``passthrough(e)``: an
    error the caller handles itself, raised as it is. ``truncated(e)``: the error says the file
    is shorter than its listed size (the last one is then an input error naming it). Each failed
    try is logged (``quiet``: at debug level only; the final error says how many were made)."""
    delay = BACKOFF_S
    for n in range(1, ATTEMPTS + 1):
        try:
            return attempt()
        except Retry as r:
            failed = r
        except (OlmaxError, ConfigError):
            raise
        except Exception as e:  # transport errors of the client libraries
            if passthrough is not None and passthrough(e):
                raise
            final = final_error(url, e, noun)
            if final is not None:
                raise final from None
            failed = Retry(url, f"{what} failed", cause(e), detail=short_error(e),
                           truncated=bool(truncated and truncated(e)) or past_end(e))
        if n == ATTEMPTS:
            if failed.truncated:
                raise OlmaxError(f"{failed.url}: truncated: {failed.detail} (the file is shorter "
                                 f"than its listed size; after {ATTEMPTS} attempts)") from None
            raise RestartableError(f"{failed.url}: {what} failed after {ATTEMPTS} attempts: "
                                   f"{failed.cause}") from None
        (log.debug if quiet else log.warning)(
            "%s: %s (attempt %d of %d, retrying in %.2f s): %s",
            failed.url, failed.failed, n, ATTEMPTS, delay, failed.cause)
        time.sleep(delay)
        delay = min(2 * delay, MAX_BACKOFF_S)
    raise AssertionError("unreachable")


__all__ = ["url_scheme", "is_url", "check_location", "check_endpoints", "NotFound", "Retry",
           "retried", "final_error", "connection_trouble", "cause", "chain", "http_status",
           "error_code", "past_end", "short_error", "ATTEMPTS", "BACKOFF_S", "MAX_BACKOFF_S",
           "RETRY_STATUS", "SCHEMES", "BUCKET_SCHEMES", "BUCKET_NAME"]
