"""The quality protocols' arithmetic (turboquant/evaluation.py) against obvious float64 references."""

import math

import pytest
import torch

from turboquant import evaluation as ev


def test_token_nlls_pick_each_predicted_token():
    torch.manual_seed(0)
    log_probs = torch.randn(5, 11).log_softmax(-1)
    window = torch.randint(0, 11, (1, 9))
    nlls = ev.token_nlls(log_probs, window)
    expected = [-log_probs[i, window[0, 4 + i]].item() for i in range(5)]  # the last 5 tokens of 9
    assert nlls.tolist() == pytest.approx(expected, abs=0)
    assert ev.nll_of(log_probs, window) == (pytest.approx(sum(expected), rel=1e-6), 5)


def test_perplexity_change_is_the_ratio_of_perplexities_with_a_paired_standard_error():
    torch.manual_seed(1)
    reference = torch.rand(200, dtype=torch.float64) * 4
    nlls = reference + 0.05 + 0.1 * torch.randn(200, dtype=torch.float64)
    change, error = ev.perplexity_change(reference, nlls)
    ratio = math.exp(nlls.mean().item()) / math.exp(reference.mean().item())
    assert change == pytest.approx(100 * (ratio - 1), rel=1e-9)
    d = (nlls - reference).tolist()
    mean = sum(d) / len(d)
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    assert error == pytest.approx(100 * ratio * std / math.sqrt(len(d)), rel=1e-9)
    assert ev.perplexity_change(reference, reference) == (0.0, 0.0)


@pytest.mark.parametrize("shapes", [((3,), (4,)), ((1,), (1,)), ((2, 2), (2, 2))])
def test_perplexity_change_refuses_unpaired_nlls(shapes):
    with pytest.raises(ValueError, match="perplexity_change"):
        ev.perplexity_change(torch.zeros(shapes[0]), torch.zeros(shapes[1]))


def test_mean_kl_is_the_mean_over_positions_of_the_kl_divergence():
    torch.manual_seed(2)
    p = torch.randn(4, 7, dtype=torch.float64).log_softmax(-1)
    q = torch.randn(4, 7, dtype=torch.float64).log_softmax(-1)
    expected = sum((p[i].exp() * (p[i] - q[i])).sum().item() for i in range(4)) / 4
    assert ev.mean_kl(p, q) == pytest.approx(expected, rel=1e-9)
    assert ev.mean_kl(p, p) == pytest.approx(0.0, abs=1e-12)
