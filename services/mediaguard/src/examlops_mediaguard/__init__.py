"""Mediaguard service: validates media parts before any engine call; never fetches media."""
