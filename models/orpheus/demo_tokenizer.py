"""A tiny tokenizer whose special and audio tokens sit at the official Orpheus ids.

Text maps to one id per UTF-8 byte (id = byte value, GPT-2 byte-level alphabet), not to Llama-3's
BPE merges, so text ids differ from the real tokenizer; every id the prompt format and the audio
mapping use is official: `<|begin_of_text|>` 128000 (prepended as BOS), `<|eot_id|>` 128009,
Llama-3's other specials at 128001..128255, and `<custom_token_N>` at 128256 + N for
N = 0..28682. Ids 256..127999 are unused filler entries that encoding never produces (the BPE
model has no merges), which is what puts the added tokens at their official ids.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .tokens import AUDIO_TOKEN_END, BEGIN_OF_TEXT, LLAMA3_VOCAB_SIZE

BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
# Llama-3.1/3.2 names of the specials that have one; the rest are reserved_special_token_k.
_NAMED_SPECIALS = {
    128000: BOS, 128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>",
    128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128008: "<|eom_id|>",
    128009: EOT, 128010: "<|python_tag|>",
}
NUM_CUSTOM_TOKENS = AUDIO_TOKEN_END - LLAMA3_VOCAB_SIZE + 1  # 28683, as pretrain/train.py adds


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def special_token_names() -> list[str]:
    """Names of ids 128000..128255 in order."""
    reserved = iter(range(256))
    return [
        _NAMED_SPECIALS.get(i) or f"<|reserved_special_token_{next(reserved)}|>"
        for i in range(BEGIN_OF_TEXT, LLAMA3_VOCAB_SIZE)
    ]


def build_demo_tokenizer() -> Tokenizer:
    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
    vocab |= {f"<|unused_{i}|>": i for i in range(256, BEGIN_OF_TEXT)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in special_token_names()])
    # Official pretraining adds these with `tokenizer.add_tokens`: added, not special.
    tok.add_tokens([AddedToken(f"<custom_token_{n}>", normalized=False) for n in range(NUM_CUSTOM_TOKENS)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BEGIN_OF_TEXT)]
    )
    for token_id, name in ((BEGIN_OF_TEXT, BOS), (LLAMA3_VOCAB_SIZE, "<custom_token_0>")):
        if tok.token_to_id(name) != token_id:  # tokenizers assigns added ids in order
            raise RuntimeError(f"demo tokenizer: {name} got id {tok.token_to_id(name)}, expected {token_id}")
    return tok
