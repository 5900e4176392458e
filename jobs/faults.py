"""Injectable crash points, so tests can kill a run between any two writes (I4).

`TXN_FAULT_AT=<step>` names the step at which the run dies. By default the
run raises `InjectedFault` (in-process tests; the job treats it like a crash
and leaves its lease behind); with `TXN_FAULT_MODE=exit` the process ends at
once with `os._exit(FAULT_EXIT_CODE)`, with `TXN_FAULT_MODE=kill` by SIGKILL:
no `finally`, no lease release, no flushing; with `TXN_FAULT_MODE=term`
(or `term-twice`) the process sends itself one SIGTERM (or two) and goes on,
as a scheduler stopping it would. Steps: `after_lease`,
`after_intent`, `after:<table path>` after each output write (e.g.
`after:_sys/pending`; the writes run concurrently, so in no fixed order, and a
crash at one may find others done or under way, as a real crash would), and
`after_commit` (the COMMITTED row written, the lease not yet released).
"""

from __future__ import annotations

import os
import signal
import threading

FAULT_EXIT_CODE = 97

#: every step passed in this process, in order (tests enumerate the kill points from it)
SEEN: list[str] = []


class InjectedFault(RuntimeError):
    """A crash simulated at a named step."""


def fault_point(step: str) -> None:
    SEEN.append(step)
    if os.environ.get("TXN_FAULT_AT") != step:
        return
    mode = os.environ.get("TXN_FAULT_MODE")
    if mode in ("term", "term-twice"):
        for _ in range(1 if mode == "term" else 2):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        return
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode in ("exit", "kill"):
        os._exit(FAULT_EXIT_CODE)
    raise InjectedFault(f"fault injected at step {step!r}")
