"""Program-style frontend (installed as ``radixkv.frontend``).

Talks to the runtime only through a small backend interface; it arrives with the
frontend issue.
"""
