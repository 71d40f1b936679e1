"""Peer adapters: replay benchmark traces against other projects' prefix caches."""
