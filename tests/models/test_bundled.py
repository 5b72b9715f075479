"""The bundled pair loads with plain transformers (no gbv engine) and generates."""

import json

import pytest
import torch

from gbv.errors import GbvError
from gbv.models import bundled
from gbv.models.bundled import BUNDLED_DIR, bundled_paths

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = bundled_paths()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    tok_t = AutoTokenizer.from_pretrained(target_dir)
    tok_d = AutoTokenizer.from_pretrained(draft_dir)
    return target, draft, tok_t, tok_d


def test_paths():
    target_dir, draft_dir = bundled_paths()
    assert target_dir == BUNDLED_DIR / "target" and draft_dir == BUNDLED_DIR / "draft"
    for d in (target_dir, draft_dir):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "llama"
        assert cfg["max_position_embeddings"] >= 1024


def test_total_size_small():
    total = sum(p.stat().st_size for p in BUNDLED_DIR.rglob("*") if p.is_file())
    assert total <= 40 * 2**20


def test_missing_files_error(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path)
    with pytest.raises(GbvError, match="missing"):
        bundled.bundled_paths()


def test_vocab_and_tokenizers_match(loaded):
    target, draft, tok_t, tok_d = loaded
    assert target.config.vocab_size == draft.config.vocab_size == len(tok_t) == len(tok_d)
    assert tok_t.get_vocab() == tok_d.get_vocab()
    assert target.config.eos_token_id == draft.config.eos_token_id == tok_t.eos_token_id
    # the target costs more than the draft
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers and n_t > n_d


def test_greedy_generate(loaded):
    from gbv.data import load_prompts

    target, draft, tok, _ = loaded
    prompt = load_prompts("gsm8k", limit=1)[0]
    enc = tok(prompt, return_tensors="pt")
    assert enc.input_ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        out = target.generate(**enc, max_new_tokens=8, do_sample=False)
        out2 = target.generate(**enc, max_new_tokens=8, do_sample=False)
        logits = draft(**enc).logits
    new = out[0, enc.input_ids.shape[1]:]
    assert 1 <= len(new) <= 8
    assert torch.equal(out, out2)
    assert torch.isfinite(logits).all()
    text = tok.decode(new, skip_special_tokens=True)
    assert isinstance(text, str)


def test_draft_shares_the_target_tokenizer_files():
    # the draft was distilled from the target with its tokenizer: the files are byte copies
    target_dir, draft_dir = bundled_paths()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (target_dir / f).read_bytes() == (draft_dir / f).read_bytes(), f
