import random

import pytest

from mstar.models.orpheus import tokens as T


def custom(n: int) -> int:
    """Id of `<custom_token_n>` in the Orpheus tokenizer (Llama-3's 128256 ids come first)."""
    return 128256 + n


def official_convert_to_audio_split(frame_codes):
    """The level split of orpheus_tts/decoder.py::convert_to_audio, transcribed index by index."""
    c0, c1, c2 = [], [], []
    for j in range(len(frame_codes) // 7):
        i = 7 * j
        c0.append(frame_codes[i])
        c1 += [frame_codes[i + 1], frame_codes[i + 4]]
        c2 += [frame_codes[i + 2], frame_codes[i + 3], frame_codes[i + 5], frame_codes[i + 6]]
    return c0, c1, c2


def test_special_ids_are_the_official_custom_tokens():
    assert (T.START_OF_SPEECH, T.END_OF_SPEECH) == (custom(1), custom(2)) == (128257, 128258)
    assert (T.START_OF_HUMAN, T.END_OF_HUMAN) == (custom(3), custom(4)) == (128259, 128260)
    assert (T.START_OF_AI, T.END_OF_AI, T.PAD) == (custom(5), custom(6), custom(7)) == (128261, 128262, 128263)
    assert T.AUDIO_TOKEN_OFFSET == custom(10) == 128266
    assert (T.BEGIN_OF_TEXT, T.END_OF_TEXT) == (128000, 128009)
    # pretrain/train.py adds custom tokens 0 .. 7*4096+10: the last audio code's token is the last one.
    assert T.AUDIO_TOKEN_END - 1 == custom(7 * 4096 + 9) and T.AUDIO_TOKEN_END + 1 == custom(7 * 4096 + 11)
    assert T.ORPHEUS_VOCAB_SIZE == 156940 > T.AUDIO_TOKEN_END


def test_prompt_is_wrapped_exactly_as_format_prompt():
    text_ids = [128000, 11, 22, 33]
    assert T.wrap_prompt_ids(text_ids) == [128259, 128000, 11, 22, 33, 128009, 128260, 128261, 128257]


def test_build_prompt_puts_voice_before_text():
    seen = []

    def encode(s):
        seen.append(s)
        return [T.BEGIN_OF_TEXT, *s.encode()]

    ids = T.build_prompt_ids(encode, "Hi!", "leo")
    assert seen == ["leo: Hi!"]
    assert ids == [128259, 128000, *b"leo: Hi!", 128009, 128260, 128261, 128257]
    assert T.prompt_text("Hi!", None) == "Hi!"


def test_unknown_voice_names_the_known_ones():
    with pytest.raises(ValueError, match="Unknown Orpheus voice 'bob'.*tara, leah, jess, leo, dan, mia, zac, zoe"):
        T.prompt_text("hello", "bob")
    assert T.prompt_text("hola", "javi", voices=("javi",)) == "javi: hola"  # other checkpoints' voices


@pytest.mark.parametrize("position", range(7))
def test_token_code_mapping_matches_official_formula(position):
    for code in (0, 1, 2047, 4095):
        token = T.audio_token_id(code, position)
        n = token - 128256  # official: int(N) - 10 - (index % 7) * 4096 for "<custom_token_N>"
        assert n - 10 - position * 4096 == code == T.code_of_token(token, position)
        assert T.is_audio_token(token)


def test_token_for_another_position_is_rejected_with_its_range():
    token = T.audio_token_id(5, 3)
    with pytest.raises(T.InvalidAudioToken, match=r"position 2: expected an id in \[136458, 140554\)"):
        T.code_of_token(token, 2)
    for bad in (T.END_OF_SPEECH, T.AUDIO_TOKEN_OFFSET - 1, T.AUDIO_TOKEN_END):
        assert not T.is_audio_token(bad)
        with pytest.raises(T.InvalidAudioToken):
            T.code_of_token(bad, 0)
    with pytest.raises(ValueError, match="SNAC code"):
        T.audio_token_id(4096, 0)
    with pytest.raises(ValueError, match="frame position"):
        T.audio_token_id(0, 7)


def test_codes_from_tokens_strict_names_the_bad_token_index():
    good = T.tokens_from_codes([7, 8, 9])
    with pytest.raises(T.InvalidAudioToken, match="generated token #3"):
        T.codes_from_tokens([*good, T.END_OF_SPEECH])


def test_codes_from_tokens_skip_drops_without_advancing_position():
    codes = [0, 4095, 3, 4, 5, 6, 7, 0]  # code 0 kept (the official `token > 0` would drop it)
    toks = T.tokens_from_codes(codes)
    noisy = [T.START_OF_SPEECH, toks[0], 42, *toks[1:4], T.audio_token_id(1, 6), *toks[4:], T.END_OF_SPEECH]
    assert T.codes_from_tokens(noisy, skip_invalid=True) == codes


def test_snac_split_matches_official_convert_to_audio():
    rng = random.Random(0)
    codes = [rng.randrange(4096) for _ in range(7 * 5)]
    snac = T.snac_codes(codes)
    assert (list(snac.level0), list(snac.level1), list(snac.level2)) == official_convert_to_audio_split(codes)
    assert T.snac_codes(list(range(7))).levels == ((0,), (1, 4), (2, 3, 5, 6))
    assert T.frame_codes(snac) == codes
    assert T.codes_from_tokens(T.tokens_from_codes(codes)) == codes


def test_snac_split_rejects_partial_frames_and_bad_codes():
    with pytest.raises(ValueError, match="8 codes is not a whole number.*1 left over"):
        T.snac_codes([0] * 8)
    with pytest.raises(ValueError, match="code #3 = 4096"):
        T.snac_codes([0, 0, 0, 4096, 0, 0, 0])
    with pytest.raises(ValueError, match=r"\(F, 2F, 4F\)"):
        T.SnacCodes((1,), (1,), (1, 2, 3, 4))


def test_llm_node_outputs_codes_and_stops_only_at_end_of_speech():
    """The LLM node's per-token outputs (cached one-element tensors) and its loop stop."""
    import torch

    from mstar.models.base import NodeCall
    from mstar.models.orpheus.llm_node import OrpheusLLM
    from mstar.services.engines.seq_engine import SeqOutput
    from mstar.services.engines.sequence import SeqStatus

    node = OrpheusLLM.__new__(OrpheusLLM)  # no engine: outputs / check_stop need none
    state: dict = {}
    tokens = [T.AUDIO_TOKEN_OFFSET + p * T.CODES_PER_POSITION + 5 for p in range(7)] + [T.END_OF_SPEECH]
    codes, stops = [], []
    for i, (given, drawn) in enumerate(zip(tokens, tokens[1:] + [T.END_OF_SPEECH], strict=True)):
        call = NodeCall("r", "decode", i, {"token": torch.tensor([given])}, {}, state)
        out = node.outputs(call, SeqOutput("r", drawn, SeqStatus.RUNNING))
        assert out["token"].tolist() == [drawn]
        codes.append(out["code"].tolist())
        stops.append(node.check_stop(call, out))
    assert codes == [[5]] * 7 + [[]]  # end of speech is no code
    assert stops == [False] * 6 + [True, True]  # the loop ends once end of speech was drawn
    assert state["codes"] == 7


def test_llm_node_says_why_the_stream_ends():
    """``finish`` of a decode call: end-of-speech sampled (also by prefill) vs the engine done at max_tokens."""
    import torch

    from mstar.models.base import NodeCall
    from mstar.models.orpheus.llm_node import OrpheusLLM
    from mstar.services.engines.seq_engine import SeqOutput
    from mstar.services.engines.sequence import SeqStatus

    node = OrpheusLLM.__new__(OrpheusLLM)  # outputs() only: no engine
    code = T.AUDIO_TOKEN_OFFSET + 5

    def decode(rid, given, token, iteration=4):
        """``token``: the sequence's next output (a SeqOutput), or None once it has ended."""
        call = NodeCall(rid, "decode", iteration, {"token": torch.tensor([given])}, {}, {})
        assert node.prepare(call) is None  # a decode call takes the sequence's next output
        out = node.outputs(call, token)
        return out["token"].item(), out["finish"].tolist(), node.check_stop(None, out)

    running, stopped = SeqStatus.RUNNING, SeqStatus.FINISHED_STOPPED
    # finish = [why, tokens sampled]: iteration 4 was given the 5th token (prefill drew the 1st)
    assert decode("a", code, SeqOutput("a", code, running)) == (code, [T.FINISH_NONE], False)
    assert decode("b", code, SeqOutput("b", T.END_OF_SPEECH, stopped)) == (T.END_OF_SPEECH, [T.FINISH_STOP, 6], True)
    assert decode("c", code, None) == (T.END_OF_SPEECH, [T.FINISH_LENGTH, 5], True)  # max_tokens=5
    assert decode("d", T.END_OF_SPEECH, None, iteration=0) == (T.END_OF_SPEECH, [T.FINISH_STOP, 1], True)
