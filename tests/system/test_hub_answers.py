"""The Hub check where the Hub answers (trainer/fetch/hub.py): a local listening socket stands in for
the Hub and for a proxy. The out-of-reach side is tests/cli/test_one_line_rule.py's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from trainer.fetch.hub import OFFLINE_VARS, PROXY_VARS, hub_unreachable

DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*OFFLINE_VARS, *PROXY_VARS, "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A socket listening on a free local port, which counts the connections it is asked for."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(5.0)
        yield server


def _url(server: socket.socket) -> str:
    return f"http://127.0.0.1:{server.getsockname()[1]}"


def _was_asked(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except TimeoutError:
        return False


def test_a_hub_that_answers_leaves_the_clients_online(clean_env, listener):
    clean_env.setenv("HF_ENDPOINT", _url(listener))
    assert hub_unreachable(timeout=2.0) is None
    assert _was_asked(listener)
    assert not any(var in os.environ for var in OFFLINE_VARS)


def test_the_proxy_is_asked_not_the_hub(clean_env, listener):
    clean_env.setenv("HF_ENDPOINT", DEAD)  # out of reach directly, as behind a firewall
    clean_env.setenv("HTTPS_PROXY", _url(listener))
    assert hub_unreachable(timeout=2.0) is None
    assert _was_asked(listener)
    assert not any(var in os.environ for var in OFFLINE_VARS)


def test_a_proxy_that_does_not_answer_is_named(clean_env, listener):
    clean_env.setenv("HF_ENDPOINT", _url(listener))  # the Hub would answer; the proxy is the way there
    clean_env.setenv("HTTPS_PROXY", DEAD)
    reason = hub_unreachable(timeout=2.0)
    assert reason and reason.startswith("127.0.0.1:9 does not answer"), reason
    assert all(os.environ[var] == "1" for var in OFFLINE_VARS)


def test_the_hub_client_stays_online_after_the_check(clean_env, listener):
    """huggingface_hub reads HF_HUB_OFFLINE once, at import: a fresh interpreter imports it after the
    check, as `dtrain prepare data=hf` does."""
    pytest.importorskip("huggingface_hub")
    script = ("import sys; from trainer.fetch.hub import hub_unreachable; assert hub_unreachable(2.0) is None; "
              "from huggingface_hub import constants; print(constants.HF_HUB_OFFLINE)")
    # none of the Hub's own switches from this session (TRANSFORMERS_OFFLINE sets huggingface_hub offline too)
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS and not k.startswith(("HF_", "TRANSFORMERS_"))}
    env["HF_ENDPOINT"] = _url(listener)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
