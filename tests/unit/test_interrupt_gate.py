"""``tandem.interrupts``: a signal that arrives inside a section runs its handler when the
section ends (never inside it), with the program's handlers left as they were."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tandem.interrupts import deferred_interrupts, gated_signals


class Boom(Exception):
    pass


def _send_and_wait(sig: int) -> None:
    """Deliver ``sig`` to ourselves and give its handler every chance to run now."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)


@pytest.mark.timeout(30)
def test_a_programs_handler_waits_for_the_section_and_raises_after_it():
    calls: list[int] = []

    def handler(signum, frame):
        calls.append(signum)
        raise Boom

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with gated_signals():
            assert signal.getsignal(signal.SIGUSR1) is not handler  # routed through the gate
            with pytest.raises(Boom):
                with deferred_interrupts():
                    with deferred_interrupts():  # nested: held until the outer one ends
                        _send_and_wait(signal.SIGUSR1)
                    assert calls == [], "the handler ran inside a section"
                    reached_end = True
            assert reached_end and calls == [signal.SIGUSR1]
            with pytest.raises(Boom):  # outside a section it runs at once
                _send_and_wait(signal.SIGUSR1)
        assert signal.getsignal(signal.SIGUSR1) is handler, "the program's handler was not put back"
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.timeout(30)
def test_ctrl_c_waits_for_a_section_without_the_gate():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            _send_and_wait(signal.SIGINT)
            reached_end = True
    assert reached_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
