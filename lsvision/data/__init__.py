"""Embedded demo datasets, built from files already on the machine (no downloads)."""
