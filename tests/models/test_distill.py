"""The distillation stage of scripts/train_bundled_pair.py: loss and held-out acceptance."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_bundled_pair.py"


@pytest.fixture(scope="module")
def tbp():
    spec = importlib.util.spec_from_file_location("train_bundled_pair", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny(tbp, hidden=32, layers=1, seed=0):
    torch.manual_seed(seed)
    return tbp.make_model(hidden, layers, 2, 64, 50, 0, 64).eval()


def test_distill_loss_is_kl_and_ce(tbp):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(2, 5, 50, generator=g)
    q = torch.randn(2, 5, 50, generator=g)
    y = torch.randint(0, 50, (2, 5), generator=g)
    loss0, kl0, _ = tbp.distill_loss(p.clone(), p, y, 0.0)
    assert abs(loss0.item()) < 1e-6 and abs(kl0) < 1e-6
    loss, kl, ce = tbp.distill_loss(q, p, y, 0.0)
    ref_kl = torch.nn.functional.kl_div(q.log_softmax(-1).reshape(-1, 50),
                                        p.log_softmax(-1).reshape(-1, 50), log_target=True,
                                        reduction="batchmean")
    assert kl == pytest.approx(ref_kl.item(), rel=1e-5) and kl > 0
    ref_ce = torch.nn.functional.cross_entropy(q.reshape(-1, 50), y.reshape(-1)).item()
    assert ce == pytest.approx(ref_ce, rel=1e-5)
    mix, _, _ = tbp.distill_loss(q, p, y, 0.25)
    assert mix.item() == pytest.approx(0.75 * kl + 0.25 * ce, rel=1e-5)


def test_heldout_acceptance_is_overlap(tbp):
    target, other = tiny(tbp, seed=0), tiny(tbp, seed=1)
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = target(input_ids=x[:, :-1]).logits.float()
        lq = other(input_ids=x[:, :-1]).logits.float()
    same = tbp.heldout_distill_metrics(target, [x], [lp])
    for t in tbp.ACCEPT_TEMPERATURES:
        assert same[f"accept_T{t}"] == pytest.approx(1.0, abs=1e-5)
    assert same["kl"] == pytest.approx(0.0, abs=1e-5)
    diff = tbp.heldout_distill_metrics(other, [x], [lp])
    for t in tbp.ACCEPT_TEMPERATURES:
        ref = torch.minimum((lp / t).softmax(-1), (lq / t).softmax(-1)).sum(-1).mean().item()
        assert diff[f"accept_T{t}"] == pytest.approx(ref, rel=1e-5) and ref < 1.0


def test_init_from_target_copies_shared_tensors(tbp):
    target, draft = tiny(tbp, layers=3, seed=0), tiny(tbp, layers=1, seed=1)
    tbp.init_draft_from_target(draft, target)
    tsd = target.state_dict()
    for k, v in draft.state_dict().items():
        assert torch.equal(v, tsd[k]), k
    with pytest.raises(SystemExit, match="hidden size"):
        tbp.init_draft_from_target(tiny(tbp, hidden=16), target)
