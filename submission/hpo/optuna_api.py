"""The one place that uses Optuna's private names: a study's storage (``Study._storage``)
and a trial's storage id (``Trial._trial_id`` / ``FrozenTrial._trial_id``). Optuna has no
public way to fail another worker's RUNNING trial or to read a trial's current state from
the storage, and a minor release may rename either: a rename is fixed here, in one file.

Owns: those two reaches, behind what the study needs of them.
Never: decides anything (worker.py says when a trial fails and is retried).
"""
from __future__ import annotations


def current(ostudy, trial):
    """The trial (a Trial or a FrozenTrial) as the storage holds it now: another worker may
    have failed it meanwhile."""
    return ostudy._storage.get_trial(trial._trial_id)


def fail_running(ostudy, trial, why: str) -> bool:
    """Mark a RUNNING trial - any worker's - FAIL, with user attribute ``fail_reason``;
    False when it had finished meanwhile (the storage refuses a finished trial's change)."""
    from optuna.trial import TrialState
    storage = ostudy._storage
    try:
        storage.set_trial_user_attr(trial._trial_id, "fail_reason", why)
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    except Exception:  # finished meanwhile (its worker was alive after all): nothing to do
        return False
    return True
