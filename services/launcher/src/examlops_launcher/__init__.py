"""Launcher service: substrate adapters behind one interface (plan, start, status, stop)."""
