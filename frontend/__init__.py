"""Program-style frontend (installed as ``radixkv.frontend``, re-exported from ``radixkv``).

    from radixkv import function, system, user, assistant, gen, select, EngineBackend

Talks to the runtime only through a backend: ``EngineBackend`` (in-process Engine) or
``RuntimeEndpoint`` (a ``radixkv serve`` process over HTTP). See ``program.py``.
"""

from radixkv.frontend.backends import Backend, BackendError, CallResult, EngineBackend, RuntimeEndpoint
from radixkv.frontend.program import (
    CacheReport,
    CallRecord,
    ForkGroup,
    ProgramError,
    ProgramState,
    ProgramFunction,
    UnknownVariableError,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    select,
    set_default_backend,
    system,
    user,
)

__all__ = [
    "Backend", "BackendError", "CallResult", "EngineBackend", "RuntimeEndpoint", "CacheReport", "CallRecord",
    "ForkGroup", "ProgramError", "ProgramState", "ProgramFunction", "UnknownVariableError", "assistant",
    "assistant_begin", "assistant_end", "function", "gen", "select", "set_default_backend", "system", "user",
]  # fmt: skip
