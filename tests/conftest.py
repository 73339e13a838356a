"""Shared pytest hooks: the header names this CPU, so a failure report names the hardware."""

from __future__ import annotations

from resource_guard.devices import cpu_summary


def pytest_report_header() -> str:
    return f"cpu: {cpu_summary()}"
