"""CRH geometry (CylindricalAnalysis) on synthetic difference vectors with a known axis and normal plane."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llm.evaluation import (
    ConceptDetector,
    CylindricalAnalysis,
    LLMJudgeDetector,
    RegexConceptDetector,
    sector_predictability,
    steerability,
    steerability_correlation,
    steerability_relation,
)

D, N = 32, 200


def _synthetic(seed: int = 0, noise: float = 0.01):
    r"""d_q = c·a + r_q (cos φ_q e1 + sin φ_q e2) + noise, with a, e1, e2 orthonormal and φ uniform on a circle."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(D, 3, generator=g, dtype=torch.float64))
    a, e1, e2 = basis.T
    c = 2.0
    half = N // 2
    r = (0.5 + 2.5 * torch.rand(half, generator=g, dtype=torch.float64)).repeat(2)
    phi = 2 * math.pi * torch.rand(half, generator=g, dtype=torch.float64)
    # balanced (φ and φ + π with the same r): the normal parts average to exactly 0, so the mean is c·a + noise
    phi = torch.cat([phi, phi + math.pi])
    d = c * a + r[:, None] * (torch.cos(phi)[:, None] * e1 + torch.sin(phi)[:, None] * e2)
    d = d + noise * torch.randn(N, D, generator=g, dtype=torch.float64)
    return d, a, e1, e2, c, r, phi


def test_recovers_axis_theta_plane_and_normal_directions():
    d, a, e1, e2, c, r, phi = _synthetic()
    ca = CylindricalAnalysis(d.float())
    assert float(ca.axis_unit @ a) > 0.99
    # θ: with the normal parts averaging out, tan θ_q = r_q / c up to the noise and the mean's residual normal part
    expected_cos = c / torch.sqrt(c**2 + r**2)
    assert (ca.cos_theta - expected_cos).abs().max() < 0.05
    torch.testing.assert_close(ca.sin_theta**2 + ca.cos_theta**2, torch.ones(N, dtype=torch.float64))
    # the normal plane: principal angles to span(e1, e2) are small (singular values of the cross-Gram ~1)
    plane = ca.normal_plane(2)
    torch.testing.assert_close(plane @ plane.T, torch.eye(2, dtype=torch.float64), atol=1e-10, rtol=0)
    cosines = torch.linalg.svdvals(plane @ torch.stack([e1, e2]).T)
    assert float(cosines.min()) > 0.99
    assert ca.normal_variance_explained(2) > 0.98
    assert ca.plane_recoverability(2, folds=5) > 0.95
    # u_q ≈ cos φ e1 + sin φ e2 (up to the small axis misestimate)
    u_true = torch.cos(phi)[:, None] * e1 + torch.sin(phi)[:, None] * e2
    assert float((ca.normal_directions * u_true).sum(-1).min()) > 0.95
    assert (ca.normal_components @ ca.axis_unit).abs().max() < 1e-5


def test_isotropic_normal_part_has_no_plane():
    g = torch.Generator().manual_seed(3)
    d = torch.randn(N, D, generator=g, dtype=torch.float64) + 3.0 * torch.eye(D, dtype=torch.float64)[0]
    ca = CylindricalAnalysis(d)
    assert ca.plane_recoverability(2) < 4.0 / (D - 1)


def test_penalty_vector_formula_and_axis_only():
    d, *_ = _synthetic(seed=1)
    ca = CylindricalAnalysis(d)
    q, length, p = 7, 3.0, 0.25
    cos = float(d[q] @ ca.axis / (d[q].norm() * ca.axis.norm()))
    a_hat = ca.axis / ca.axis.norm()
    normal = d[q] - (d[q] @ a_hat) * a_hat
    u = normal / normal.norm()
    by_hand = length * (cos * a_hat + (1 - p) * math.sqrt(1 - cos**2) * u)
    torch.testing.assert_close(ca.penalty_vector(q, length, p), by_hand)
    axis_only = ca.penalty_vector(q, length, 1.0)
    torch.testing.assert_close(axis_only.norm(), torch.tensor(length * cos, dtype=torch.float64))
    assert float(torch.nn.functional.cosine_similarity(axis_only, ca.axis, dim=0)) == pytest.approx(1.0)
    # p = 0 points along d_q itself with length L
    full = ca.penalty_vector(q, length, 0.0)
    torch.testing.assert_close(full, length * d[q] / d[q].norm())
    with pytest.raises(ValueError, match="p must be"):
        ca.penalty_vector(q, length, 1.5)


def test_sweep_steerability_and_correlation():
    d, *_ = _synthetic(seed=2, noise=0.0)
    ca = CylindricalAnalysis(d)
    lengths = [0.1 * i for i in range(31)]  # fine enough that the first-success L resolves 1 / cos θ

    def success_fn(q: int, v: torch.Tensor) -> float:
        # succeeds once the axial component of the vector passes 1: axis-only steering then needs L ≥ 1/cos θ
        return float(v @ ca.axis_unit >= 1.0)

    grid = ca.sweep(success_fn, lengths, penalties=(1.0, 0.0))
    assert grid.shape == (N, 2, len(lengths))
    result = steerability(grid[:, 0], lengths)
    expected = torch.tensor(
        [min((x for x in lengths if x * c >= 1.0), default=math.inf) for c in ca.cos_theta.tolist()],
        dtype=torch.float64,
    )
    torch.testing.assert_close(result.per_sample, expected)
    assert result.slope > 0
    corr = steerability_correlation(result.per_sample, ca.sin_theta, ca.cos_theta)
    assert corr["spearman_sin"] > 0.8 and corr["spearman_cos"] < -0.8
    assert corr["pearson_sin"] > 0.6
    assert corr["n"] == float(torch.isfinite(expected).sum())
    # a sample never reaching the threshold is inf, and "cap" keeps it in the correlation
    never = steerability(torch.zeros(3, len(lengths)), lengths)
    assert torch.isinf(never.per_sample).all() and never.slope == 0.0
    capped = steerability_correlation(
        torch.tensor([1.0, 2.0, math.inf, 1.5]),
        torch.tensor([0.1, 0.5, 0.9, 0.2]),
        torch.zeros(4),
        never="cap",
    )
    assert capped["n"] == 4 and capped["spearman_sin"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="increasing"):
        steerability(torch.zeros(2, 3), [0.0, 2.0, 1.0])


def test_held_out_axis_measures_test_angles_against_the_training_mean():
    # Training questions all point along e1 (their mean is 2·e1). Test questions at 60° and 30° from e1: their
    # own mean lies between them (±15°), the authors' held-out axis gives the true 60° and 30°.
    e = torch.eye(3, dtype=torch.float64)
    train = torch.stack([2.0 * e[0], 2.0 * e[0] + 0.5 * e[2], 2.0 * e[0] - 0.5 * e[2]])
    angles = torch.tensor([math.pi / 3, math.pi / 6], dtype=torch.float64)
    test = 3.0 * (torch.cos(angles)[:, None] * e[0] + torch.sin(angles)[:, None] * e[1])
    held = CylindricalAnalysis.held_out(train, test)
    torch.testing.assert_close(held.axis, 2.0 * e[0])
    torch.testing.assert_close(held.cos_theta, torch.cos(angles))
    torch.testing.assert_close(held.sin_theta, torch.sin(angles))
    torch.testing.assert_close(held.normal_directions, e[1].expand(2, 3))
    own = CylindricalAnalysis(test)
    torch.testing.assert_close(own.theta, torch.full((2,), math.pi / 12, dtype=torch.float64))
    # The penalty vector at p = 1 is the training axis direction scaled by L cos θ.
    torch.testing.assert_close(held.penalty_vector(0, 4.0, 1.0), 4.0 * 0.5 * e[0])
    with pytest.raises(ValueError, match="axis must be"):
        CylindricalAnalysis(test, axis=torch.ones(2))


def test_authors_length_grid_and_step_slope():
    d = torch.tensor([[2.0, 0.0], [2.0, 1.0], [2.0, -1.0]], dtype=torch.float64)  # ‖a‖ = 2
    grid = CylindricalAnalysis(d).length_grid()
    torch.testing.assert_close(grid, torch.arange(1, 26, dtype=torch.float64) * 6.0 / 25)
    # Success rises by 1/3 per step on a doubling grid: the authors' slope is per step, ours per unit of L.
    lengths = [1.0, 2.0, 4.0, 8.0]
    success = torch.tensor([[0.0, 1 / 3, 2 / 3, 1.0]])
    st = steerability(success, lengths)
    assert st.step_slope == pytest.approx(1 / 3)
    centred = torch.tensor(lengths) - 3.75
    assert st.slope == pytest.approx(float((centred * (success[0] - 0.5)).sum() / (centred**2).sum()))
    # On the authors' equal-step grid the two differ by the step length.
    rates = torch.linspace(0.0, 1.0, 25, dtype=torch.float64)[None]
    on_grid = steerability(rates, grid)
    assert on_grid.step_slope == pytest.approx(on_grid.slope * 6.0 / 25)


def test_authors_relation_is_one_for_an_exact_power_law_and_uses_both_exponents():
    g = torch.Generator().manual_seed(0)
    theta = 0.2 + 1.2 * torch.rand(30, generator=g, dtype=torch.float64)
    norm = 1.0 + 3.0 * torch.rand(30, generator=g, dtype=torch.float64)
    # s = 0.7 · ‖a‖^P · sin^P θ · cos^c θ: y = s / ‖a‖^P is exactly 0.7 x.
    steer = 0.7 * norm**2.5 * torch.sin(theta) ** 2.5 * torch.cos(theta) ** -0.5
    exact = steerability_relation(torch.sin(theta), torch.cos(theta), steer, norm, power=2.5, cos_power=-0.5)
    assert exact["pearson"] == pytest.approx(1.0) and exact["n"] == 30
    off = steerability_relation(torch.sin(theta), torch.cos(theta), steer, norm, power=2.5, cos_power=1.5)
    assert off["pearson"] < 0.99
    unnormalised = steerability_relation(
        torch.sin(theta), torch.cos(theta), steer, norm, power=0.0, cos_power=-0.5
    )
    assert unnormalised["pearson"] < 0.99
    with pytest.raises(ValueError, match="positive"):
        steerability_relation(torch.ones(3), torch.ones(3), torch.ones(3), torch.zeros(3))


def test_spearman_handles_ties():
    corr = steerability_correlation(
        torch.tensor([1.0, 1.0, 2.0, 3.0]),
        torch.tensor([0.0, 0.0, 1.0, 2.0]),
        torch.tensor([3.0, 2.0, 1.0, 0.0]),
    )
    assert corr["spearman_sin"] == pytest.approx(1.0)
    assert corr["spearman_cos"] < -0.9


def test_sector_predictability_high_when_determined_by_features_and_not_otherwise():
    d, *_, phi = _synthetic(seed=4)
    ca = CylindricalAnalysis(d)
    coords = ca.plane_coordinates(2)
    torch.testing.assert_close(coords.norm(dim=-1), torch.ones(N, dtype=torch.float64))
    g = torch.Generator().manual_seed(5)
    informative = torch.cat(
        [torch.cos(phi)[:, None], torch.sin(phi)[:, None], torch.randn(N, 6, generator=g)], 1
    )
    good = sector_predictability(informative, coords, alpha=1.0)
    assert good["r2"] > 0.9 and good["mean_cosine"] > 0.9
    noise = torch.randn(N, 8, generator=g)
    bad = sector_predictability(noise, coords, alpha=1.0)
    assert bad["r2"] < 0.1 and abs(bad["mean_cosine"]) < 0.3


def test_regex_detector():
    detector = RegexConceptDetector(r"\bfire\b")
    assert isinstance(detector, ConceptDetector)
    assert detector(["the fire, the sea", "firewood", "FIRE", ""]) == [True, False, False, False]
    assert RegexConceptDetector(r"\bfire\b", flags=2)(["FIRE"]) == [True]


def test_llm_judge_detector_parses_strictly():
    prompts: list[str] = []
    replies = iter(["Yes", " no.", '"YES"', "yes!", "Yes, it does", "import os; os.system('x')", "maybe"])

    def judge(prompt: str) -> str:
        prompts.append(prompt)
        return next(replies)

    detector = LLMJudgeDetector(judge, concept="fire", on_invalid="false")
    assert detector(["a", "b", "c", "d", "e", "f", "g"]) == [True, False, True, True, False, False, False]
    assert "'fire'" in prompts[0] and "Text: a" in prompts[0]
    strict = LLMJudgeDetector(lambda _: "Yes, definitely", concept="fire")
    with pytest.raises(ValueError, match="yes/no"):
        strict(["x"])
    assert LLMJudgeDetector.parse("  No  ") is False
    assert LLMJudgeDetector.parse("nope") is None
    with pytest.raises(ValueError, match="text"):
        LLMJudgeDetector(judge, concept="fire", template="no field")


def test_bad_inputs():
    with pytest.raises(ValueError, match="N >= 2"):
        CylindricalAnalysis(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="no axis"):
        CylindricalAnalysis(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    with pytest.raises(ValueError, match="k must be"):
        CylindricalAnalysis(torch.randn(5, 3) + 1).normal_plane(7)
