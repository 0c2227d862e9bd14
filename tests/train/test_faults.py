"""The injected faults beside NaN and spikes (issue 40, item 5): a rank that exits, one that hangs, a save
that fails as a full disk does, and the attempt a fault strikes under --max-restarts."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from moetrain.errors import UserError
from moetrain.train.faults import Fault, injected_faults, parse_fault


def test_exit_hang_and_save_error_parse_with_their_defaults():
    assert parse_fault("1:5:exit") == Fault(1, 5, "exit", "step", 3.0, 0)
    assert parse_fault("1:5:exit=9:save") == Fault(1, 5, "exit", "save", 9.0, 0)
    assert parse_fault("*:2:hang") == Fault(None, 2, "hang", "step", 3600.0, 0)
    assert parse_fault("0:4:save_error") == Fault(0, 4, "save_error", "save", 1.0, 0)
    assert parse_fault("0:4:kill@1").attempt == 1 and parse_fault("0:4:kill@*").attempt is None
    assert parse_fault("1:2:hang=8:load@1") == Fault(1, 2, "hang", "load", 8.0, 1)
    phases = "PHASE is step, save (raise, kill, exit, hang, save_error) or load (raise, kill, exit, hang)"
    for bad, message in (("0:4:save_error:step", phases), ("0:4:save_error:load", phases), ("0:4:nan:load", phases),
                         ("0:4:kill=2", "KIND is one of"), ("0:4:kill@x", "ATTEMPT (or *) are integers")):
        with pytest.raises(UserError, match=re.escape(message)):
            parse_fault(bad)


def test_a_fault_strikes_its_attempt_only(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert injected_faults(0, "0:4:save_error").save_error(4) is False  # the first attempt's fault
    assert injected_faults(0, "0:4:save_error@1").save_error(4) is True
    assert injected_faults(0, "0:4:save_error@*").save_error(4) is True
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    faults = injected_faults(0, "0:4:save_error,0:3:hang=0.2,0:3:exit")
    assert faults.save_error(4) and not faults.save_error(3)
    assert faults.loss_scale(3) == 1.0  # an exit's code or a hang's seconds never scale the loss


def test_hang_sleeps_and_exit_ends_the_process_with_its_code():
    start = time.monotonic()
    injected_faults(0, "0:3:hang=0.2")(3, "step")
    assert time.monotonic() - start >= 0.2
    code = "from moetrain.train.faults import injected_faults; injected_faults(1, '1:2:exit=7')(2, 'step'); print('on')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7 and proc.stdout == ""
