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


def _tiny_model():
    transformers = pytest.importorskip("transformers", reason="the protocols run transformers models")
    from transformers.models.qwen2 import Qwen2Config
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_chunked_protocols_give_the_nll_of_one_full_forward():
    from transformers import DynamicCache
    model = _tiny_model()
    window = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(window).logits[0].double().log_softmax(-1)  # no cache: the reference
    expected = -full[:-1].gather(1, window[0, 1:, None])[:, 0]  # NLL of tokens 1..39
    serving = ev.serving_token_nlls(model, window, DynamicCache, chunk=16)
    assert serving.shape == (39,)
    torch.testing.assert_close(serving.double(), expected, atol=1e-4, rtol=1e-4)
    total, count = ev.serving_nll(model, window, DynamicCache, chunk=16)
    log_probs = ev.serving_log_probs(model, window, DynamicCache, chunk=16)
    assert log_probs.shape == (39, 64)
    torch.testing.assert_close(log_probs.double(), full[:-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ev.token_nlls(log_probs, window).double(), expected, atol=1e-4, rtol=1e-4)
    assert count == 39 and total == pytest.approx(expected.sum().item(), rel=1e-5)
    decoded = ev.token_nlls(ev.decode_log_probs(model, window, DynamicCache, tail=8, chunk=16), window)
    torch.testing.assert_close(decoded.double(), expected[-8:], atol=1e-4, rtol=1e-4)


def test_mean_kl_is_the_mean_over_positions_of_the_kl_divergence():
    torch.manual_seed(2)
    p = torch.randn(4, 7, dtype=torch.float64).log_softmax(-1)
    q = torch.randn(4, 7, dtype=torch.float64).log_softmax(-1)
    expected = sum((p[i].exp() * (p[i] - q[i])).sum().item() for i in range(4)) / 4
    assert ev.mean_kl(p, q) == pytest.approx(expected, rel=1e-9)
    assert ev.mean_kl(p, p) == pytest.approx(0.0, abs=1e-12)
