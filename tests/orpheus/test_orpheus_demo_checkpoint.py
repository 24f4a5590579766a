"""The demo writer's output loads with our loaders, with transformers and with snac."""

import pytest
import torch

from mstar.models.orpheus import tokens as T
from mstar.models.orpheus.checkpoint import (
    llama_tensor_shapes,
    load_tokenizer,
    open_checkpoint,
    validate_shapes,
)
from mstar.models.orpheus.demo_checkpoint import DEMO_SNAC, write_random_snac
from mstar.models.orpheus.snac import load_snac_decoder


@pytest.fixture(scope="module")
def llm_files(demo_checkpoint):
    return open_checkpoint(demo_checkpoint.llm_dir)


def test_llm_validates_against_llama_shapes(llm_files):
    assert llm_files.config["vocab_size"] == T.ORPHEUS_VOCAB_SIZE
    validate_shapes(llm_files, llama_tensor_shapes(llm_files.config))  # exact: no missing, no extra


def test_llm_loads_with_transformers_and_runs_a_prompt(demo_checkpoint, llm_files):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(demo_checkpoint.llm_dir).eval()
    prompt = T.build_prompt_ids(lambda s: load_tokenizer(llm_files).encode(s).ids, "Hello", "tara")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), T.ORPHEUS_VOCAB_SIZE) and torch.isfinite(logits).all()
    assert model.generation_config.eos_token_id == T.END_OF_SPEECH


def test_tokenizer_puts_specials_at_official_ids(llm_files):
    tok = load_tokenizer(llm_files)
    prompt = T.build_prompt_ids(lambda s: tok.encode(s).ids, "Hé!", "tara")
    assert prompt == [128259, 128000, *"tara: Hé!".encode(), 128009, 128260, 128261, 128257]
    names = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>",
             128257: "<custom_token_1>", 128266: "<custom_token_10>", 156938: "<custom_token_28682>"}
    assert {i: tok.id_to_token(i) for i in names} == names
    assert tok.get_vocab_size() == T.AUDIO_TOKEN_END + 1  # 156939 named ids; the model has 156940 rows
    assert tok.decode(prompt[1:-4], skip_special_tokens=True) == "tara: Hé!"
    # Generated audio tokens as text, the form the official streaming decoder parses.
    assert tok.decode(T.tokens_from_codes([5, 0]), skip_special_tokens=False) == "<custom_token_15><custom_token_4106>"


def test_tokenizer_loads_with_transformers(demo_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_checkpoint.llm_dir)
    assert tok("tara: hi").input_ids == [128000, *b"tara: hi"]
    assert tok.convert_tokens_to_ids(["<custom_token_3>", "<|eot_id|>"]) == [T.START_OF_HUMAN, T.END_OF_TEXT]


def test_snac_loads_with_snac_and_ours_identically(demo_checkpoint):
    import snac

    ref = snac.SNAC.from_pretrained(str(demo_checkpoint.snac_dir))  # strict load_state_dict
    ours = load_snac_decoder(demo_checkpoint.snac_dir)
    assert ours.config == DEMO_SNAC and ours.config.samples_per_frame == 2048
    codes = [torch.randint(0, 4096, (1, 3 * m), generator=torch.Generator().manual_seed(m)) for m in (1, 2, 4)]
    torch.manual_seed(0)
    want = ref.decode(codes)
    torch.manual_seed(0)
    torch.testing.assert_close(ours.decode(codes), want, atol=1e-6, rtol=0)
    assert want.abs().max() > 1e-2  # not a silent all-zero model


def test_random_snac_is_deterministic_per_seed(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        write_random_snac(tmp_path / name, DEMO_SNAC, seed=seed)
    a, b, c = (torch.load(tmp_path / n / "pytorch_model.bin", weights_only=True) for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
