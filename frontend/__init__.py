"""Program-style frontend (installed as ``radixkv.frontend``, re-exported from ``radixkv``).

    from radixkv import function, system, user, assistant, gen, select, EngineBackend

Talks to the runtime only through a backend: ``EngineBackend`` (in-process Engine),
``RuntimeEndpoint`` (a ``radixkv serve`` process over HTTP) or ``OpenAIBackend`` (any
OpenAI-compatible server). See ``program.py``; ``choices.py`` for ``select``'s methods.
"""

from radixkv.frontend.backends import (
    Backend,
    BackendError,
    CallResult,
    EngineBackend,
    OpenAIBackend,
    RuntimeEndpoint,
)
from radixkv.frontend.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
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
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)

__all__ = [
    "Backend", "BackendError", "CallResult", "EngineBackend", "OpenAIBackend", "RuntimeEndpoint", "CacheReport",
    "CallRecord", "ChoicesDecision", "ChoicesSamplingMethod", "ForkGroup", "ProgramError", "ProgramState",
    "ProgramFunction", "UnknownVariableError", "assistant", "assistant_begin", "assistant_end", "function", "gen",
    "greedy_token_selection", "select", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]  # fmt: skip
