"""Wiring: main window, CLI entry point, settings."""
