"""Reading a Prometheus endpoint in tests."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> str:
    """The text of ``http://<address>/metrics``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape_when(address: str, ready: Callable[[str], bool], timeout_s: float = 10.0) -> str:
    """Scrape until ``ready(text)`` holds (counters updated just after a call's end), at most ``timeout_s``;
    returns the last text either way, for the test's own asserts to report."""
    deadline = time.monotonic() + timeout_s
    text = scrape(address)
    while not ready(text) and time.monotonic() < deadline:
        time.sleep(0.05)
        text = scrape(address)
    return text


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (at least one must exist)."""
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert values, f"no sample {name} {labels}"
    return sum(values)
