"""AQN sigma schedules and the entropy-feedback controller."""

from __future__ import annotations

import math

import pytest

from qerl.errors import QerlConfigError
from qerl.noise.controller import EntropyFeedbackController
from qerl.noise.schedules import (
    SHAPES,
    NoiseSchedule,
    NoNoise,
    StagedSchedule,
    build_schedule,
)
from qerl.params import ControllerParams as ControllerConfig
from qerl.params import NoiseParams as NoiseConfig
from qerl.validation import validate_block

DECAYING = ("exponential", "linear", "cosine", "logarithmic")


@pytest.mark.parametrize("shape", DECAYING)
def test_stage_boundaries(shape):
    s = StagedSchedule(shape, 1e-2, 5e-4, stages=10, total_steps=100)
    assert [s.stage(step) for step in (0, 9, 10, 19, 90, 99, 150)] == [0, 0, 1, 1, 9, 9, 9]
    assert s.sigma(0) == 0.0 and s.sigma(9) == 0.0  # stage 0: quantization noise alone
    assert s.sigma(10) == pytest.approx(1e-2)  # first noisy stage: sigma_start
    assert s.sigma(99) == pytest.approx(5e-4)  # last stage: sigma_end
    values = [s.sigma_of_stage(k) for k in range(1, 10)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))  # strictly decaying
    assert all(5e-4 <= v <= 1e-2 + 1e-15 for v in values)


def test_exponential_matches_paper_formula():
    s = StagedSchedule("exponential", 1e-2, 1e-4, stages=10, total_steps=10)
    for k in range(1, 10):
        assert s.sigma(k) == pytest.approx(1e-2 * (1e-4 / 1e-2) ** ((k - 1) / 8))


def test_shape_midpoints():
    # K = 4: noisy stages 1, 2, 3 at t = 0, 1/2, 1 -> stage 2 is the midpoint of each shape.
    assert StagedSchedule("linear", 1.0, 0.0, 4, 4).sigma(2) == pytest.approx(0.5)
    assert StagedSchedule("cosine", 1.0, 0.0, 4, 4).sigma(2) == pytest.approx(0.5)
    assert StagedSchedule("exponential", 1.0, 0.25, 4, 4).sigma(2) == pytest.approx(0.5)
    assert StagedSchedule("logarithmic", 1.0, 0.0, 4, 4).sigma(2) == pytest.approx(
        1 - math.log1p((math.e - 1) / 2))
    # K = 3: the second noisy stage is already the last one.
    for shape in DECAYING:
        assert StagedSchedule(shape, 1.0, 0.25, 3, 3).sigma(2) == pytest.approx(0.25)


def test_two_stages_and_constant_and_none():
    two = StagedSchedule("exponential", 1e-2, 5e-4, stages=2, total_steps=10)
    assert [two.sigma(i) for i in (0, 4, 5, 9)] == [0.0, 0.0, 1e-2, 1e-2]
    const = StagedSchedule("constant", 3e-3, 5e-4, stages=4, total_steps=8)
    assert [const.sigma(i) for i in range(8)] == [0.0, 0.0] + [3e-3] * 6
    assert all(NoNoise().sigma(i) == 0.0 for i in range(5))
    assert isinstance(two, NoiseSchedule) and isinstance(NoNoise(), NoiseSchedule)


@pytest.mark.parametrize("kwargs, field", [
    ({"schedule": "step"}, "noise.schedule"),
    ({"stages": 1}, "noise.stages"),
    ({"sigma_start": -1.0}, "noise.sigma_start"),
    ({"sigma_end": float("inf")}, "noise.sigma_end"),
    ({"sigma_end": 0.0}, "noise.sigma_end"),  # exponential needs > 0
    ({"schedule": "entropy_feedback", "controller": {"sigma_min": 0.0}},
     "noise.controller.sigma_min"),
    ({"schedule": "entropy_feedback", "controller": {"sigma_min": 1.0, "sigma_max": 0.1}},
     "noise.controller.sigma_max"),
    ({"schedule": "entropy_feedback", "controller": {"up": 0.9}}, "noise.controller.up"),
    ({"schedule": "entropy_feedback", "controller": {"down": 1.0}}, "noise.controller.down"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(QerlConfigError) as err:
        validate_block("qerl", {"noise": kwargs})
    assert err.value.field.startswith(f"qerl.{field.rsplit('.', 1)[0]}"), err.value


def test_build_schedule():
    assert isinstance(build_schedule(NoiseConfig(enabled=False), 10), NoNoise)
    assert isinstance(build_schedule(NoiseConfig(schedule="none"), 10), NoNoise)
    for shape in SHAPES:
        assert isinstance(build_schedule(NoiseConfig(schedule=shape), 10), StagedSchedule)
    ctrl = build_schedule(NoiseConfig(schedule="entropy_feedback"), 10)
    assert isinstance(ctrl, EntropyFeedbackController) and ctrl.sigma(0) == 1e-2
    assert build_schedule(NoiseConfig(), 100).sigma(99) == pytest.approx(5e-4)


def test_controller_raises_lowers_and_clamps():
    c = EntropyFeedbackController(1e-3, ControllerConfig(sigma_min=5e-4, sigma_max=2e-3, up=1.5,
                                                         down=0.5, window=1))
    assert c.update(1.0) == 1e-3  # baseline only
    assert c.update(1.1) == pytest.approx(1.5e-3)  # improving -> raise
    assert c.update(1.2) == pytest.approx(2e-3)  # clamped at sigma_max
    assert c.update(1.15) == pytest.approx(1e-3)  # worse than best -> lower
    assert c.update(1.19) == pytest.approx(5e-4)  # still below best 1.2 -> lower
    assert c.update(0.1) == pytest.approx(5e-4)  # clamped at sigma_min
    assert c.best_entropy == pytest.approx(1.2)


def test_controller_moving_window_and_observe():
    c = EntropyFeedbackController(1e-3, ControllerConfig(window=3, up=2.0, down=0.5))
    c.observe(0, 3.0)  # avg 3 -> baseline
    c.observe(1, 0.0)  # avg 1.5 -> lower
    assert c.sigma(1) == pytest.approx(5e-4)
    c.observe(2, 9.0)  # avg 4 > 3 -> raise
    assert c.sigma(2) == pytest.approx(1e-3) and c.best_entropy == pytest.approx(4.0)
    with pytest.raises(QerlConfigError, match="entropy"):
        c.update(float("nan"))


def test_controller_state_round_trip():
    cfg = ControllerConfig(window=2, up=1.3, down=0.8)
    a = EntropyFeedbackController(1e-3, cfg)
    for e in (1.0, 1.2, 0.9, 1.4):
        a.update(e)
    b = EntropyFeedbackController(5e-3, cfg)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for e in (1.5, 0.2, 2.0):
        assert b.update(e) == a.update(e)
    with pytest.raises(QerlConfigError):
        b.load_state_dict({"sigma": 1e-3})
