"""Whether the Hugging Face hub can be reached, decided in seconds, before a hub id is fetched.

Without a network, huggingface_hub and datasets retry each request with backoff: 25-35 s and a
dozen "Retrying in 8s" lines before the error. One HEAD request to the hub, bounded by
``PROBE_TIMEOUT`` and made once per process, tells first. When it gets no answer,
hub files are taken from the local hub cache only, and a miss is one line saying how to pass a
local directory instead. ``HF_HUB_OFFLINE=1`` skips the probe: the libraries then read the
cache without touching the network, as they document. Torch-free, like ``checkpoint.source``.
"""

from __future__ import annotations

import os
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

from posttune.errors import PosttuneError

PROBE_TIMEOUT = 3.0  # seconds for name resolution and the TCP handshake together
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = ("1", "true", "yes", "on")
_probed: dict[str, bool] = {}


def offline_requested(*, datasets: bool = False) -> bool:
    """``HF_HUB_OFFLINE=1`` (for datasets also ``HF_DATASETS_OFFLINE=1``): keep the library off the network."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if datasets else ("HF_HUB_OFFLINE",)
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in names)


def endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT`` (a mirror), else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def reachable(timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the hub answers an HTTP request within ``timeout``; asked once per process and endpoint."""
    url = endpoint()
    if url not in _probed:
        _probed[url] = _answers(url, timeout)
    return _probed[url]


def unreachable(repo_id: str, what: str, *, local: str = "a local checkpoint directory",
                cache_tried: bool = True) -> PosttuneError:
    """The one-line error for a hub id that cannot be fetched because the hub cannot be reached.

    ``cache_tried``: the local hub cache was looked in (huggingface_hub downloads); else the
    message says how to read it (``datasets`` has no cache-only switch per call).
    """
    why = f"no answer from {endpoint()} within {PROBE_TIMEOUT:g} s"
    if cache_tried:
        return PosttuneError(f"{what}: {repo_id!r} is a Hugging Face hub id, but the hub is unreachable ({why}) "
                             f"and the local hub cache does not hold it; pass {local} instead (fetch one where "
                             f"the hub is reachable: `posttune download {repo_id} -o DIR`)")
    return PosttuneError(f"{what}: {repo_id!r} is a Hugging Face hub id, but the hub is unreachable ({why}); "
                         f"pass {local} instead, or set HF_HUB_OFFLINE=1 to read what the local hub cache holds")


def first_part_exists(text: str) -> bool:
    """``models/llama`` with a local ``models`` folder is a mistyped local path, not a hub id."""
    head = text.split("/", 1)[0]
    return bool(head) and Path(head).expanduser().exists()


def _answers(url: str, timeout: float) -> bool:
    """A HEAD request in a thread, so a hanging name lookup is bounded by ``timeout`` too.

    Any HTTP answer counts, whatever its status, and so does a certificate the system does not
    trust (the hub's own client may trust it): only silence or a refused connection is "unreachable".
    A TCP connection alone proves nothing: some networks accept every connection and drop it.
    Proxies come from the environment, as for the hub's client.
    """
    result: list[bool] = []

    def attempt() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result.append(True)
        except urllib.error.HTTPError:
            result.append(True)
        except urllib.error.URLError as exc:
            result.append(isinstance(exc.reason, ssl.SSLCertVerificationError))
        except (OSError, ValueError):
            result.append(False)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])
