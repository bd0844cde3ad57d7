"""Devices: pointer tables, launches, counters."""
