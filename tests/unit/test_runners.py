"""runtime.train.runners: the set-up order as code - the parts built under the runner
(``building``: a captured mode's stream first), then ``attach`` with the restored step - and
a runner that refuses to be driven out of that order."""
import types

import pytest
import torch

from runtime.train.runners import Drive, runner_for, swapped


def _drive(start_step: int = 0) -> Drive:
    body = types.SimpleNamespace(captured=None, accum=1)
    meter = types.SimpleNamespace(hooked=None, paused=None)
    return Drive(body, meter, schedule=lambda t: 0.1, max_steps=10, start_step=start_step)


def test_attach_comes_after_building_and_once():
    runner = runner_for("none", torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"attach\(\) once, after building\(\)"):
        runner.attach(_drive())
    with runner.building():
        pass
    with pytest.raises(RuntimeError, match=r"building\(\) once, before attach\(\)"):
        with runner.building():
            pass
    drive = _drive()
    runner.attach(drive)
    with pytest.raises(RuntimeError, match=r"attach\(\) once"):
        runner.attach(drive)


def test_the_rows_captures_reach_the_body_and_the_meter_from_one_place():
    """Eager: autocast's cast cache on, the meter's hooks on; a captured mode: both off - and
    back for the run's own runner after a swapped one (nothing is captured before a step)."""
    eager = runner_for("none", torch.device("cpu"))
    with eager.building():
        pass
    drive = _drive()
    eager.attach(drive)
    assert drive.body.captured is False and drive.meter.hooked is True
    with swapped(eager, "full", start_step=3) as other:
        assert other.drive.start_step == 3 and other.drive.body is drive.body
        assert int(other.device_step) == 3 and not other.graph.captured
        assert drive.body.captured is True and drive.meter.hooked is False
    assert drive.body.captured is False and drive.meter.hooked is True


def test_a_captured_mode_off_cuda_is_refused_before_anything_is_built():
    from runtime.choices import ConfigError
    runner = runner_for("full", torch.device("cpu"))
    built = []
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        with runner.building():
            built.append("parts")
    assert built == []
