"""Which host names are this machine's own: `is_loopback`, for the checks that an address others must reach is
not the loopback (the config's, `llm-serving start`'s API-key warning, `llm-serving agent`'s --host).

A leaf: it imports nothing of the project, so the config, the command line and the agents ask it without
importing one another.
"""
from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or 'localhost') is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
