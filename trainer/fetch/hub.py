"""Whether the Hugging Face Hub can be reached, asked once and fast before a Hub client starts
(`dtrain prepare data=hf` streaming a Hub dataset; the harness's tasks).

Offline, `datasets` and `huggingface_hub` retry each request with backoff (about half a minute per
dataset or task) before they give up; with HF_HUB_OFFLINE=1 they read their cache only and fail at
once. So dtrain asks first (the environment, else one TCP connection with a short timeout) and, when
the Hub is out of reach, sets both libraries offline for itself and the workers it starts: a task
whose data is cached still runs, a dataset or task that is not is one line at once.

Standard library only: it must run before `datasets` / `huggingface_hub` are imported (they read
these variables at import).
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")  # the Hub's clients honour them too
HUB_ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 3.0
OFFLINE_SET = "HF_HUB_OFFLINE is set"  # hub_unreachable's reason when the user set offline mode
_TRUE = ("1", "true", "yes", "on")


def hub_unreachable(timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why the Hub is out of reach (None when it answers); when out of reach, sets the Hub's
    clients offline (OFFLINE_VARS) in this process's environment, which its workers inherit."""
    if any(os.environ.get(var, "").lower() in _TRUE for var in OFFLINE_VARS):
        return OFFLINE_SET
    proxy = next((os.environ[v] for v in PROXY_VARS if os.environ.get(v)), None)  # through it, when set
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as err:
        reason = f"{host}:{port} does not answer ({err.strerror or type(err).__name__})"
    for var in OFFLINE_VARS:
        os.environ[var] = "1"
    return reason
