"""Thin CLI layers: parse flags, call the engine, print."""
